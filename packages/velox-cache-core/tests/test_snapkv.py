"""What is special to SnapKV: `snapkv_compress` at the end of the prompt (the window plus the
best avg_pool1d-smoothed scores), never evicting otherwise. Agreement with the numpy reference
(core_reference_siblings.ReferenceSnapKV, prompt end and decode included), prompt-split
invariance and the shared guarantees are in test_policy_contract.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_harness import make_stream, state_positions
from core_reference_lanes import reference_lanes_keep
from core_reference_siblings import ReferenceSnapKV

from velox_cache_core import SnapKVState, init_snapkv_state, snapkv_compress, snapkv_update
from velox_cache_core import lanes as LN
from velox_cache_core.allocation import shares as AS
from velox_cache_core.attention import attend


def test_compress_fresh_and_below_budget() -> None:
    fresh = init_snapkv_state(budget=8, window=2)
    assert isinstance(fresh, SnapKVState)
    done = snapkv_compress(fresh)
    assert done.compressed and done.n_kept == 0
    keys, values, queries = make_stream(1, 2, 2, 4, 5, seed=0)
    state = snapkv_update(fresh, mx.array(keys), mx.array(values), mx.array(queries)).state
    done = snapkv_compress(state)
    assert done.compressed and state_positions(done) == [[list(range(5))] * 2]
    assert not state.compressed  # the input state is unchanged


def test_compress_needs_a_snapkv_state() -> None:
    with pytest.raises(TypeError, match="state"):
        snapkv_compress(object())  # type: ignore[arg-type]


def test_window_always_kept_and_pool_by_hand() -> None:
    # One head, key signal, window 1: the last key [s, 0, ...] probes the prompt; pooled scores
    # with kernel 3 favour the neighbourhood of the two aligned keys.
    d, n = 4, 10
    keys = np.zeros((1, 1, n, d), dtype=np.float32)
    keys[0, 0, 2, 0] = 3.0
    keys[0, 0, 6, 0] = 2.0
    keys[0, 0, n - 1, 0] = 1.0
    state = snapkv_update(
        init_snapkv_state(budget=4, window=1, kernel=3, signal="key"),
        mx.array(keys),
        mx.array(keys),
        scale=1.0,
    ).state
    ref = ReferenceSnapKV(4, 1, 3, "key")
    ref.feed(keys, keys, scale=1.0)
    ref.compress()
    kept = state_positions(snapkv_compress(state))
    assert kept == ref.positions()
    # Scores e^[0,0,3,0,0,0,2,0,0]/Z pooled over 3: every window holding the peak at 2 (1, 2
    # and 3) beats every window holding 6.
    assert kept[0][0] == [1, 2, 3, n - 1]
    prefix = np.exp([0, 0, 3, 0, 0, 0, 2, 0, 0, 1.0])
    probs = (prefix / prefix.sum())[:-1]
    pooled = np.convolve(np.pad(probs, 1), np.ones(3) / 3, mode="valid")
    top = sorted(np.argsort(-pooled, kind="stable")[:3].tolist())
    assert kept[0][0] == [*top, n - 1]


def test_decode_without_compress_never_evicts() -> None:
    keys, values, queries = make_stream(1, 1, 1, 4, 12, seed=4)
    state = init_snapkv_state(budget=3, window=1)
    for t in range(12):
        part = slice(t, t + 1)
        state = snapkv_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            mx.array(queries[:, :, part]),
        ).state
    assert state.n_kept == 12


@pytest.mark.parametrize(("budget", "window"), [(2, 1), (8, 7), (32, 31), (33, 32), (512, 32)])
def test_default_window_fits_the_budget(budget: int, window: int) -> None:
    # The default window is the paper's 32 where the budget leaves room for it, else budget - 1.
    assert init_snapkv_state(budget=budget).window == window


def test_explicit_window_is_still_checked() -> None:
    with pytest.raises(ValueError, match="window must be < budget"):
        init_snapkv_state(budget=8, window=8)
    with pytest.raises(TypeError, match="window"):
        init_snapkv_state(budget=8, window=2.0)  # type: ignore[arg-type]


def _snap_scores(keys, queries, window: int, kernel: int, scale: float) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Loops: the last ``window`` queries' softmax over the keys up to each, summed, averaged
    over the GQA group, then the prefix pooled (zero padding counted) -> ``[B, H, n]`` with
    the window's rows at +inf (always kept)."""
    B, H, n, _ = keys.shape
    g = queries.shape[1] // H
    out = np.zeros((B, H, n))
    for b in range(B):
        for h in range(H):
            acc = np.zeros(n)
            for qh in range(h * g, (h + 1) * g):
                for t in range(n - window, n):
                    lg = keys[b, h, : t + 1].astype(np.float64) @ queries[b, qh, t] * scale
                    p = np.exp(lg - lg.max())
                    acc[: t + 1] += p / p.sum() / g
            prefix = acc[: n - window]
            pad = kernel // 2
            pooled = np.convolve(np.pad(prefix, pad), np.ones(kernel) / kernel, mode="valid")
            out[b, h] = np.concatenate([pooled, np.full(window, np.inf)])
    return out


@pytest.mark.parametrize(("budget", "window", "floor"), [(16, 4, 0.2), (24, 8, 0.5), (16, 2, 0.0)])
def test_head_allocation_matches_the_lanes_reference(
    budget: int, window: int, floor: float
) -> None:
    """AdaKV's shares of SnapKV's scores: every head its window and floor, the layer's
    ``budget * H`` rows by score, whole lanes; decode attends exactly over the kept rows."""
    B, H, g, n, D = 2, 3, 2, 70, 8
    keys, values, queries = make_stream(B, H, g, D, n + 4, seed=9)
    scale = D**-0.5
    state = init_snapkv_state(
        budget=budget, window=window, allocation="head", allocation_floor=floor
    )
    k, v, q = (mx.array(x[:, :, :n]) for x in (keys, values, queries))
    cut = snapkv_compress(snapkv_update(state, k, v, q, scale=scale).state)
    scores = _snap_scores(keys[:, :, :n], queries[:, :, :n], window, 5, scale)
    positions = np.broadcast_to(np.arange(n), (B, H, n))
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, window, width)
    want = reference_lanes_keep(
        scores, positions, positions >= n - window, budget * H, least, width
    )
    got = [[[p for p in row if p < LN.PAD] for row in b] for b in np.array(cut.positions).tolist()]
    assert got == want
    assert cut.nbytes == B * sum(len(h) for h in want[0]) * 2 * D * 4 <= B * budget * H * 2 * D * 4
    # decode: the new token attends over the kept rows and itself
    step = snapkv_update(cut, *(mx.array(x[:, :, n : n + 1]) for x in (keys, values, queries)))
    out = np.array(attend(mx.array(queries[:, :, n : n + 1]), step, scale))
    for b in range(B):
        for qh in range(H * g):
            seen = [*want[b][qh // g], n]
            lg = keys[b, qh // g, seen].astype(np.float64) @ queries[b, qh, n] * scale
            p = np.exp(lg - lg.max())
            ref = (p / p.sum()) @ values[b, qh // g, seen]
            np.testing.assert_allclose(out[b, qh, 0], ref, rtol=1e-4, atol=1e-5)


def test_allocation_settings_are_checked() -> None:
    state = init_snapkv_state(budget=4, window=2, allocation="global")
    rng = np.random.default_rng(0)
    k, v, q = (mx.array(rng.standard_normal((1, 2, 9, 4)).astype(np.float32)) for _ in range(3))
    state = snapkv_update(state, k, v, q).state
    with pytest.raises(ValueError, match="not linked to the others"):  # one layer alone
        snapkv_compress(state)
    with pytest.raises(ValueError, match="allocation must be one of"):
        init_snapkv_state(budget=16, allocation="layer")
    with pytest.raises(ValueError, match="allocation_floor"):
        init_snapkv_state(budget=16, allocation="head", allocation_floor=-0.1)
