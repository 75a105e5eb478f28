"""TOVA with AdaKV's head allocation (lanes that evict at every step) against a plain NumPy
reference: the held prompt, the cut at its end by the last query's weights with per-head
shares, then every decode step evicting within each head's share, outputs included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_reference_lanes import order, ref_shares
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core import lanes as LN
from velox_cache_core.allocation import shares as AS
from velox_cache_core.attention import attend

TOVA = POLICIES["tova"]


def _weights(q: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """Softmax of each query head over ``keys [n, D]``, then their mean: ``[n]``."""
    lg = keys.astype(np.float64) @ q.astype(np.float64).T * scale  # [n, g]
    p = np.exp(lg - lg.max(axis=0))
    return (p / p.sum(axis=0)).mean(axis=1)


def _lowest(weights: np.ndarray, positions: list[int], n_sink: int) -> int:
    """Index of the candidate TOVA evicts: the lowest weight among non-sinks, ties: oldest."""
    cands = [i for i, p in enumerate(positions) if p >= n_sink]
    return min(cands, key=lambda i: (weights[i], positions[i]))


def reference(keys, values, queries, n, budget, n_sink, floor, scale, signal="query"):  # type: ignore[no-untyped-def]
    """Kept positions per (b, h) after every decode step, and the decode outputs. The probe
    of the decisions is the query heads of each KV head (signal query) or the new key."""
    B, H, T, D = keys.shape
    g = queries.shape[1] // H

    def probe(b: int, h: int, t: int) -> np.ndarray:
        return queries[b, h * g : (h + 1) * g, t] if signal == "query" else keys[b, h, t][None]

    m = n - 1  # the held prompt: the cut comes with the next single token
    scores = np.zeros((B, H, m))
    for b in range(B):
        for h in range(H):
            scores[b, h] = _weights(probe(b, h, m - 1), keys[b, h, :m], scale)
    positions = np.broadcast_to(np.arange(m), (B, H, m))
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, n_sink + 2, width)
    counts = ref_shares(scores, positions, positions < n_sink, budget * H, least, width)
    live = []
    for b in range(B):
        row = []
        for h in range(H):
            kept = order(scores[b, h], positions[b, h], positions[b, h] < n_sink)[: counts[b, h]]
            dead = _lowest(scores[b, h, kept], kept, n_sink)
            row.append(sorted(p for i, p in enumerate(kept) if i != dead))
        live.append(row)
    outs = np.zeros((B, H * g, T - n + 1, D))
    history = []
    for t in range(n - 1, T):
        for b in range(B):
            for h in range(H):
                cands = [*live[b][h], t]
                qs = queries[b, h * g : (h + 1) * g, t]
                w = _weights(probe(b, h, t), keys[b, h, cands], scale)
                for j in range(g):
                    lg = keys[b, h, cands].astype(np.float64) @ qs[j] * scale
                    p = np.exp(lg - lg.max())
                    outs[b, h * g + j, t - n + 1] = (p / p.sum()) @ values[b, h, cands]
                gone = _lowest(w, cands, n_sink)
                live[b][h] = sorted(p for i, p in enumerate(cands) if i != gone)
        history.append([[list(h) for h in row] for row in live])
    return history, outs


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 1000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    g=st.integers(1, 2),
    budget=st.sampled_from([8, 16, 24]),
    n_sink=st.integers(0, 2),
    floor=st.sampled_from([0.0, 0.2, 0.5]),
    signal=st.sampled_from(["query", "key"]),
)
def test_head_allocation_matches_reference(
    seed: int, B: int, H: int, g: int, budget: int, n_sink: int, floor: float, signal: str
) -> None:
    D, n, T = 8, 3 * budget, 3 * budget + 6
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((B, H, T, D)) * 1.5).astype(np.float32)
    values = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = (rng.standard_normal((B, H * g, T, D)) * 1.5).astype(np.float32)
    scale = D**-0.5
    state = TOVA.init_for(
        "tova",
        budget=budget,
        n_sink=n_sink,
        scope="head",
        allocation="head",
        allocation_floor=floor,
        signal=signal,
    )
    k, v, q = mx.array(keys), mx.array(values), mx.array(queries)
    state = TOVA.update(state, k[:, :, : n - 1], v[:, :, : n - 1], q[:, :, : n - 1]).state
    assert state.holds_prompt and state.n_kept == n - 1  # held whole
    want, outs = reference(keys, values, queries, n, budget, n_sink, floor, scale, signal)
    for i, t in enumerate(range(n - 1, T)):
        step = TOVA.update(state, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
        got_out = np.array(attend(q[:, :, t : t + 1], step, scale))
        np.testing.assert_allclose(got_out[:, :, 0], outs[:, :, i], rtol=1e-4, atol=1e-5)
        state = step.state
        got = [
            [sorted(p for p in h if p < LN.PAD) for h in row]
            for row in np.array(state.positions).tolist()
        ]
        assert got == want[i], t
    # bytes: the shares, never more than the uniform cut's budget + 1 rows per head
    assert state.nbytes <= B * H * (budget + 1) * 2 * D * 4


def test_chunk_after_the_cut_is_token_by_token() -> None:
    B, H, g, D, budget = 1, 2, 2, 8, 8
    rng = np.random.default_rng(3)
    T = 40
    k, v, q = (
        mx.array(rng.standard_normal((B, h, T, D)).astype(np.float32)) for h in (H, H, H * g)
    )
    init = TOVA.init_for("tova", budget=budget, scope="head", allocation="head", n_sink=1)
    base = TOVA.update(init, k[:, :, :30], v[:, :, :30], q[:, :, :30]).state
    base = TOVA.update(base, k[:, :, 30:31], v[:, :, 30:31], q[:, :, 30:31]).state  # the cut
    assert base.lanes is not None
    chunk = TOVA.update(base, k[:, :, 31:35], v[:, :, 31:35], q[:, :, 31:35])
    one = base
    outs = []
    for t in range(31, 35):
        step = TOVA.update(one, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
        outs.append(attend(q[:, :, t : t + 1], step, D**-0.5))
        one = step.state
    assert mx.array_equal(chunk.state.positions, one.positions)
    np.testing.assert_allclose(
        np.array(attend(q[:, :, 31:35], chunk, D**-0.5)),
        np.array(mx.concatenate(outs, axis=2)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_allocation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="scope='head'"):
        TOVA.init_for("tova", allocation="head")  # the preset decides per layer
    with pytest.raises(ValueError, match="scope='head'"):
        TOVA.init_for("tova", allocation="global")
    with pytest.raises(ValueError, match="allocation must be one of"):
        TOVA.init_for("tova", scope="head", allocation="layer")
    state = TOVA.init_for("tova_adapted", allocation="head")  # key signal, head scope
    assert state.holds_prompt and state.allocation == "head"


def test_trims_after_the_cut_through_a_layer() -> None:
    """The call that cuts the prompt into shares cannot be taken back (it clears the undo log);
    the calls after it can, exactly (test_lanes_undo.py checks every policy on lanes)."""
    from velox_cache_core.layer import Layer
    from velox_cache_core.undo import UndoLog

    B, H, g, D = 1, 2, 2, 8
    rng = np.random.default_rng(1)
    k, v, q = (
        mx.array(rng.standard_normal((B, h, 40, D)).astype(np.float32)) for h in (H, H, H * g)
    )
    init = TOVA.init_for("tova", budget=8, scope="head", allocation="head", n_sink=1)
    layer = Layer(TOVA, init, UndoLog(8))
    states = []
    for a, b in ((0, 30), (30, 31), (31, 32), (32, 35)):
        layer.lay_out(k[:, :, a:b], v[:, :, a:b])
        layer.attend(q[:, :, a:b], D**-0.5)
        states.append(layer.state)
    assert layer.state.lanes is not None
    with pytest.raises(ValueError, match="holds the last 4"):
        layer.trim(5)  # back past the cut
    layer.trim(4)
    assert layer.offset == 31
    assert mx.array_equal(layer.state.lanes.owner, states[1].lanes.owner)
    live = np.array(layer.state.positions)
    assert (np.sort(live, axis=-1) == np.sort(np.array(states[1].positions), axis=-1)).all()
