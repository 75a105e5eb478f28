"""Expected Attention with AdaKV's head allocation against the float64 reference: the prompt's
cut into per-head shares (lanes with a dead row per head), then every decode step scoring the
new key on arrival, refreshing the statistics on schedule and evicting within each head's
share; kept positions and attention outputs after every step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_reference_expected_attention import ReferenceExpectedAttention
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core import lanes as LN
from velox_cache_core.attention import attend
from velox_cache_core.policies.expected_attention import expected_attention_compress

POLICY = POLICIES["expected_attention"]


def _kept(state: object) -> list[list[list[int]]]:
    rows = np.array(state.positions).tolist()  # type: ignore[attr-defined]
    return [[sorted(p for p in h if p < LN.PAD) for h in row] for row in rows]


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 1000),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    g=st.integers(1, 2),
    budget=st.sampled_from([8, 16]),
    n_sink=st.integers(0, 2),
    recent=st.integers(0, 3),
    floor=st.sampled_from([0.0, 0.2, 0.5]),
    refresh_every=st.integers(1, 6),
    use_covariance=st.booleans(),
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
    refresh_every: int,
    use_covariance: bool,
) -> None:
    D, n, T = 8, 3 * budget, 3 * budget + 12
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((B, H, T, D)) * 1.5).astype(np.float32)
    values = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = (rng.standard_normal((B, H * g, T, D)) * 1.5).astype(np.float32)
    state = POLICY.init(
        budget=budget,
        n_sink=n_sink,
        recent=recent,
        n_queries=6,
        refresh_every=refresh_every,
        n_future=16,
        use_covariance=use_covariance,
        rope_base=1e4,
        allocation="head",
        allocation_floor=floor,
    )
    ref = ReferenceExpectedAttention(**state.settings)
    k, v, q = mx.array(keys), mx.array(values), mx.array(queries)
    state = POLICY.update(state, k[:, :, :n], v[:, :, :n], queries=q[:, :, :n]).state
    ref.feed(keys[:, :, :n], values[:, :, :n], queries[:, :, :n])
    state = expected_attention_compress(state)
    ref.compress()
    assert state.lanes is not None and state.lanes.free is not None
    assert _kept(state) == ref.positions()
    for t in range(n, T):
        step = POLICY.update(
            state, k[:, :, t : t + 1], v[:, :, t : t + 1], queries=q[:, :, t : t + 1]
        )
        want, _ = ref.feed(keys[:, :, t : t + 1], values[:, :, t : t + 1], queries[:, :, t : t + 1])
        got = np.array(attend(q[:, :, t : t + 1], step, D**-0.5))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        state = step.state
        assert _kept(state) == ref.positions(), t
        assert state.steps == ref.count
    # the shares' bytes: never more than the uniform cut's budget rows per head (+ the dead one)
    assert state.nbytes <= B * H * (budget + 1) * 2 * D * 4


def test_heads_keep_different_counts_within_the_uniform_bytes() -> None:
    rng = np.random.default_rng(5)
    B, H, g, D, budget, n = 1, 4, 2, 8, 32, 128
    k = mx.array(rng.standard_normal((B, H, n + 1, D)) * np.arange(1, H + 1)[:, None, None])
    v = mx.array(rng.standard_normal((B, H, n + 1, D)))
    q = mx.array(rng.standard_normal((B, H * g, n + 1, D)) * 2)
    common = {"budget": budget, "n_sink": 2, "recent": 4, "rope_base": 1e4}
    shared = POLICY.init(**common, allocation="head")
    uniform = POLICY.init(**common)
    states = []
    for state in (shared, uniform):
        state = POLICY.update(state, k[:, :, :n], v[:, :, :n], queries=q[:, :, :n]).state
        state = expected_attention_compress(state)
        states.append(POLICY.update(state, k[:, :, n:], v[:, :, n:], queries=q[:, :, n:]).state)
    counts = [len(h) for h in _kept(states[0])[0]]
    assert len(set(counts)) > 1 and sum(counts) == budget * H - H  # one dead row per head
    assert states[0].nbytes <= states[1].nbytes * 1.05


def test_global_alone_is_refused_with_the_reason() -> None:
    rng = np.random.default_rng(0)
    k, v, q = (mx.array(rng.standard_normal((1, 2, 20, 8)).astype(np.float32)) for _ in range(3))
    state = POLICY.init(budget=8, n_sink=1, recent=2, rope_base=1e4, allocation="global")
    state = POLICY.update(state, k, v, queries=q).state
    with pytest.raises(ValueError, match="not linked to the others"):  # one layer alone
        expected_attention_compress(state)
    with pytest.raises(ValueError, match="allocation must be one of"):
        POLICY.init(allocation="layer")
    with pytest.raises(ValueError, match="allocation_floor"):
        POLICY.init(allocation="head", allocation_floor=2.0)
