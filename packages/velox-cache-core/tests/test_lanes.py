"""Lanes (adaptive per-head row counts) against plain NumPy references: the shares, the cut and
the attention over lanes plus a tail."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_reference_lanes import order as _order
from core_reference_lanes import ref_shares
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import lanes as LN
from velox_cache_core.allocation import shares as AS
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.store.token_rows import Quant


def _case(seed: int, B: int, H: int, n: int, D: int = 8, ties: bool = False):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((B, H, n, D)).astype(np.float32)
    values = rng.standard_normal((B, H, n, D)).astype(np.float32)
    perm = np.stack([np.stack([rng.permutation(n) for _ in range(H)]) for _ in range(B)])
    scores = rng.integers(0, 4, (B, H, n)) if ties else rng.random((B, H, n))
    return keys, values, perm.astype(np.int32), scores.astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 2),
    H=st.integers(1, 4),
    n=st.integers(8, 40),
    width=st.integers(1, 5),
    share=st.integers(1, 8),
    n_sink=st.integers(0, 3),
    ties=st.booleans(),
)
def test_shares_and_cut_match_reference(
    seed: int, B: int, H: int, n: int, width: int, share: int, n_sink: int, ties: bool
) -> None:
    keys, values, positions, scores = _case(seed, B, H, n, ties=ties)
    protected = positions < n_sink
    budget = max(min(share * width, n - 1), n_sink + 1)
    least = AS.floor_rows(budget, 0.2, n_sink, width)
    total = budget * H
    got = np.array(
        AS.shares(mx.array(scores), mx.array(positions), mx.array(protected), total, least, width)
    )
    want = ref_shares(scores, positions, protected, total, least, width)
    np.testing.assert_array_equal(got, want)
    assert (got.sum(axis=1) <= total).all()
    assert (got % width == 0).all()
    if (got.sum(axis=1) != got.sum(axis=1)[0]).any():
        return
    live = KVSlots(mx.array(keys), mx.array(values), mx.array(positions))
    lanes = LN.cut(live, mx.array(scores), mx.array(protected), got.tolist(), width)
    heads = lanes.per_head(H)
    for b in range(B):
        for h in range(H):
            order = _order(scores[b, h], positions[b, h], protected[b, h])
            kept = sorted(order[: got[b, h]])  # slot order
            real = np.array(heads.positions[b, h]) < LN.PAD
            np.testing.assert_array_equal(
                np.array(heads.positions[b, h])[real], positions[b, h, kept]
            )
            np.testing.assert_array_equal(np.array(heads.keys[b, h])[real], keys[b, h, kept])
            np.testing.assert_array_equal(np.array(heads.values[b, h])[real], values[b, h, kept])
    assert lanes.nbytes == int(got[0].sum()) * B * 2 * 8 * 4


def _reference_attention(queries, heads, tail_k, tail_v, visible, scale, sinks=None):  # type: ignore[no-untyped-def]
    B, H_q, L, _ = queries.shape
    H = tail_k.shape[1]
    g = H_q // H
    K = np.concatenate([np.array(heads.keys, np.float64), tail_k], 2)
    V = np.concatenate([np.array(heads.values, np.float64), tail_v], 2)
    real = np.array(heads.positions) < LN.PAD
    out = np.zeros((B, H_q, L, V.shape[-1]))
    for b in range(B):
        for hq in range(H_q):
            h = hq // g
            for i in range(L):
                vis = np.concatenate([real[b, h], visible[b, hq, i]])
                lg = np.where(vis, K[b, h] @ queries[b, hq, i] * scale, -np.inf)
                top = lg.max() if sinks is None else max(lg.max(), sinks[hq])
                p = np.exp(lg - top)
                den = p.sum() + (0.0 if sinks is None else np.exp(sinks[hq] - top))
                out[b, hq, i] = p @ V[b, h] / den
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    g=st.integers(1, 3),
    L=st.integers(1, 4),
    T=st.integers(0, 5),
    width=st.integers(1, 4),
    mask_kind=st.sampled_from(["none", "shared", "query", "kv"]),
    with_sinks=st.booleans(),
)
def test_attend_matches_reference(
    seed: int, B: int, H: int, g: int, L: int, T: int, width: int, mask_kind: str, with_sinks: bool
) -> None:
    n, D = 24, 8
    keys, values, positions, scores = _case(seed, B, H, n, D)
    budget = 2 * width
    counts = np.array(
        AS.shares(
            mx.array(scores), mx.array(positions), mx.array(positions < 1), budget * H, width, width
        )
    )
    if (counts.sum(axis=1) != counts.sum(axis=1)[0]).any():
        return
    live = KVSlots(mx.array(keys), mx.array(values), mx.array(positions))
    lanes = LN.cut(live, mx.array(scores), mx.array(positions < 1), counts.tolist(), width)
    rng = np.random.default_rng(seed + 1)
    T = max(T, L)
    q = rng.standard_normal((B, H * g, L, D)).astype(np.float32)
    tk = rng.standard_normal((B, H, T, D)).astype(np.float32)
    tv = rng.standard_normal((B, H, T, D)).astype(np.float32)
    causal = np.tril(np.ones((L, T), bool), k=T - L)
    mask = None
    visible = np.broadcast_to(causal, (B, H * g, L, T)).copy()
    if mask_kind == "none":
        visible[:] = True
    elif mask_kind == "shared":
        mask = mx.array(causal)[None, None]
    elif mask_kind == "query":
        visible = causal & (rng.random((B, H * g, L, T)) < 0.8)
        visible[..., -1] |= True
        mask = mx.array(visible)
    else:
        per_kv = causal & (rng.random((B, H, L, T)) < 0.8)
        per_kv[..., -1] |= True
        visible = np.repeat(per_kv, g, axis=1)
        mask = mx.array(per_kv)
    sinks = rng.standard_normal(H * g).astype(np.float32) if with_sinks else None
    got, _ = LN.attend_weights(
        mx.array(q),
        lanes,
        mx.array(tk),
        mx.array(tv),
        mask,
        0.3,
        None if sinks is None else mx.array(sinks),
    )
    want = _reference_attention(q, lanes.per_head(H), tk, tv, visible, 0.3, sinks)
    np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=2e-5)


def test_attend_quantized_lanes_reads_the_packed_rows() -> None:
    B, H, n, D, width = 1, 2, 64, 64, 8
    keys, values, positions, scores = _case(3, B, H, n, D)
    quant = Quant(4, 64)
    live = KVSlots(
        quant.quantize(mx.array(keys)), quant.quantize(mx.array(values)), mx.array(positions)
    )
    protected = mx.array(positions < 2)
    counts = np.array(AS.shares(mx.array(scores), mx.array(positions), protected, 16 * H, 8, width))
    lanes = LN.cut(live, mx.array(scores), protected, counts.tolist(), width)
    q = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(1))
    tk = quant.quantize(mx.random.normal((B, H, 1, D), key=mx.random.key(2)))
    tv = quant.quantize(mx.random.normal((B, H, 1, D), key=mx.random.key(3)))
    got, _ = LN.attend_weights(q, lanes, tk, tv, None, 0.125)
    want = _reference_attention(
        np.array(q),
        lanes.per_head(H),
        np.array(tk.dense()),
        np.array(tv.dense()),
        np.ones((B, 2 * H, 1, 1), bool),
        0.125,
    )
    np.testing.assert_allclose(np.array(got), want, atol=1e-4, rtol=1e-4)
    assert lanes.nbytes < int(counts.sum()) * 2 * D * 4 / 4


def test_global_totals_keep_the_model_within_budget() -> None:
    rng = np.random.default_rng(0)
    H, n, width, budget = 3, 64, 4, 16
    scores = [mx.array(rng.random((1, H, n)) * (i + 1)) for i in range(4)]
    positions = [mx.broadcast_to(mx.arange(n, dtype=mx.int32), (1, H, n))] * 4
    protected = [p < 2 for p in positions]
    least = AS.floor_rows(budget, 0.2, 2, width)
    totals = AS.global_totals(scores, positions, protected, budget, least, width)
    assert sum(totals) == budget * H * 4  # whole lanes: the rounding loses nothing
    assert all(t % width == 0 and t >= least * H for t in totals)
    assert totals[-1] > totals[0]  # the layer with the largest scores wins rows


@pytest.mark.parametrize("seed", range(6))
def test_whole_lane_totals_round_without_losing_rows(seed: int) -> None:
    rng = np.random.default_rng(seed)
    width, layers = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    caps = [width * int(c) for c in rng.integers(1, 10, layers)]
    raw = [int(rng.integers(0, c + 1)) for c in caps]
    totals = AS._whole_lanes(raw, caps, width, sum(raw))
    assert all(t % width == 0 and 0 <= t <= c for t, c in zip(totals, caps, strict=True))
    assert sum(raw) - width < sum(totals) <= sum(raw) or all(
        t == c for t, c in zip(totals, caps, strict=True)
    )
    assert all(abs(t - r) < width for t, r in zip(totals, raw, strict=True))


def test_bad_allocation_settings_are_named() -> None:
    with pytest.raises(ValueError, match="allocation must be one of"):
        AS.check_allocation("layer", 0.2)
    with pytest.raises(ValueError, match="allocation_floor must be in"):
        AS.check_allocation("head", 1.5)
    with pytest.raises(TypeError, match="allocation_floor"):
        AS.check_allocation("head", "0.2")
    with pytest.raises(ValueError, match="whole lanes"):
        keys, values, positions, scores = _case(0, 1, 2, 16)
        live = KVSlots(mx.array(keys), mx.array(values), mx.array(positions))
        LN.cut(live, mx.array(scores), mx.array(positions < 0), [[3, 5]], 2)
