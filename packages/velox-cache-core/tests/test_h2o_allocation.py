"""H2O with AdaKV's head allocation against a plain NumPy reference: the prompt's attention sums
accumulated while it is held, the cut into per-head shares by those sums, then decode steps that
add each step's weights and evict the lowest sum within each head's share."""

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

H2O = POLICIES["h2o"]


def _weights(q: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    lg = keys.astype(np.float64) @ q.astype(np.float64).T * scale  # [n, g]
    p = np.exp(lg - lg.max(axis=0))
    return (p / p.sum(axis=0)).mean(axis=1)


def _lowest(sums: dict[int, float], protected: set[int]) -> int:
    return min((p for p in sums if p not in protected), key=lambda p: (sums[p], p))


def reference(keys, queries, m, T, budget, n_sink, recent, floor, scale):  # type: ignore[no-untyped-def]
    B, H, _, _ = keys.shape
    g = queries.shape[1] // H
    live: list[list[dict[int, float]]] = []
    scores = np.zeros((B, H, m))
    for b in range(B):
        for h in range(H):
            for t in range(m):  # every prompt query adds its weights over what it sees
                q = queries[b, h * g : (h + 1) * g, t]
                scores[b, h, : t + 1] += _weights(q, keys[b, h, : t + 1], scale)
    positions = np.broadcast_to(np.arange(m), (B, H, m))
    protected = (positions < n_sink) | (positions > m - recent)
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, int(protected[0, 0].sum()) + 2, width)
    counts = ref_shares(scores, positions, protected, budget * H, least, width)
    for b in range(B):
        row = []
        for h in range(H):
            kept = order(scores[b, h], positions[b, h], protected[b, h])[: counts[b, h]]
            sums = {int(p): float(scores[b, h, p]) for p in kept}
            del sums[_lowest(sums, {int(p) for p in kept if protected[b, h, p]})]
            row.append(sums)
        live.append(row)
    history = []
    for t in range(m, T):
        for b in range(B):
            for h in range(H):
                sums = live[b][h]
                sums[t] = 0.0
                cands = sorted(sums)
                w = _weights(queries[b, h * g : (h + 1) * g, t], keys[b, h, cands], scale)
                for p, x in zip(cands, w, strict=True):
                    sums[p] += x
                guard = {p for p in cands if p < n_sink or p > t - recent}
                del sums[_lowest(sums, guard)]
        history.append([[sorted(s) for s in row] for row in live])
    return history


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 1000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    g=st.integers(1, 2),
    budget=st.sampled_from([16, 24]),
    n_sink=st.integers(0, 2),
    recent=st.integers(1, 4),
    floor=st.sampled_from([0.0, 0.3]),
    split=st.booleans(),
)
def test_head_allocation_matches_reference(
    seed: int,
    B: int,
    H: int,
    g: int,
    budget: int,
    n_sink: int,
    recent: int,
    floor: float,
    split: bool,
) -> None:
    D, m, T = 8, 3 * budget, 3 * budget + 6
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((B, H, T, D)) * 1.5).astype(np.float32)
    values = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = (rng.standard_normal((B, H * g, T, D)) * 1.5).astype(np.float32)
    scale = D**-0.5
    state = H2O.init(
        budget=budget, n_sink=n_sink, recent=recent, allocation="head", allocation_floor=floor
    )
    k, v, q = mx.array(keys), mx.array(values), mx.array(queries)
    for a, b in [(0, m // 2), (m // 2, m)] if split else [(0, m)]:
        state = H2O.update(state, k[:, :, a:b], v[:, :, a:b], q[:, :, a:b], scale=scale).state
    assert state.holds_prompt and state.n_kept == m
    want = reference(keys, queries, m, T, budget, n_sink, recent, floor, scale)
    for i, t in enumerate(range(m, T)):
        part = slice(t, t + 1)
        state = H2O.update(state, k[:, :, part], v[:, :, part], q[:, :, part], scale=scale).state
        got = [
            [sorted(p for p in h if p < LN.PAD) for h in row]
            for row in np.array(state.positions).tolist()
        ]
        assert got == want[i], t


def test_allocation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="scope='head'"):
        H2O.init(budget=16, scope="layer", allocation="head")
    with pytest.raises(ValueError, match="scope='head'"):
        H2O.init(budget=16, scope="layer", allocation="global")
    with pytest.raises(TypeError, match="allocation_floor"):
        H2O.init(budget=16, allocation="head", allocation_floor="0.2")
