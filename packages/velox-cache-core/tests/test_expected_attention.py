"""What is special to Expected Attention (the contract matrix in test_policy_contract.py runs it
through every shared guarantee): its RoPE un-rotation, its scoring against a float64 numpy
reference, a whole run token by token against the reference, its refresh cadence, and its
refusals."""

from __future__ import annotations

import itertools
import math
from typing import Any

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest
from core_reference_expected_attention import ReferenceExpectedAttention, rotation
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core.layer import Layer, Mode
from velox_cache_core.policies.expected_attention import expected_attention_compress
from velox_cache_core.policies.expected_scores import RoPE, expected_scores, query_stats
from velox_cache_core.undo import new_log

POLICY = POLICIES["expected_attention"]
ROPE = {"rope_base": 1e4}
EXAMPLES = hypothesis_settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(("dims", "scale"), [(16, 1.0), (8, 0.25)])
def test_unrotate_inverts_mlx_rope(traditional: bool, dims: int, scale: float) -> None:
    """The hook hands over queries after mx.fast.rope: un-rotating them at their positions
    gives the queries back (partial rotation and linear scaling included)."""
    x = mx.array(random((2, 3, 5, 16), seed=0))
    rotated = mx.fast.rope(x, dims, traditional=traditional, base=1e5, scale=scale, offset=1000)
    rope = RoPE(1e5, dims, traditional, scale)
    back = rope.unrotate(rotated, mx.arange(1000, 1005))
    np.testing.assert_allclose(np.array(back), np.array(x), atol=2e-4)


@pytest.mark.parametrize("traditional", [False, True])
def test_rotation_matrix_of_the_reference_is_mlx_rope(traditional: bool) -> None:
    """The reference's explicit R(p) is the rotation mlx applies."""
    x = random((1, 1, 1, 8), seed=1)
    rotated = mx.fast.rope(mx.array(x), 6, traditional=traditional, base=100.0, scale=1.0, offset=7)
    rope = {"base": 100.0, "dims": 6, "traditional": traditional, "scale": 1.0}
    np.testing.assert_allclose(
        np.array(rotated)[0, 0, 0], rotation(7, 8, rope) @ x[0, 0, 0], atol=1e-5
    )


# ------------------------------------------------------------------------------- scoring


def reference_stats(
    queries: np.ndarray, positions: list[int], n_sink: int, rope: dict, start: int, n_future: int
) -> tuple[np.ndarray, np.ndarray]:
    """mu' [B, H_q, D], Sigma' [B, H_q, D, D] in float64, with explicit matrices."""
    q = queries.astype(np.float64)
    used = [i for i, p in enumerate(positions) if p >= n_sink]
    rows = q[:, :, used]
    mean = rows.mean(axis=2) if used else np.zeros(q.shape[:2] + q.shape[3:])
    centered = rows - mean[:, :, None]
    cov = np.einsum("bhwi,bhwj->bhij", centered, centered) / max(len(used), 1)
    dim = q.shape[-1]
    average = sum(rotation(f, dim, rope) for f in range(start, start + n_future)) / n_future
    return average @ mean[..., None], average @ cov @ average.T


@EXAMPLES
@given(
    n_batch=st.integers(1, 2),
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    half=st.integers(2, 6),
    n=st.integers(1, 9),
    window=st.integers(1, 7),
    n_sink=st.integers(0, 3),
    use_covariance=st.booleans(),
    use_vnorm=st.booleans(),
    traditional=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scores_match_numpy(
    n_batch: int,
    n_kv: int,
    group: int,
    half: int,
    n: int,
    window: int,
    n_sink: int,
    use_covariance: bool,
    use_vnorm: bool,
    traditional: bool,
    seed: int,
) -> None:
    """query_stats + expected_scores against float64 numpy: mean and covariance of the
    un-rotated queries (sinks out), turned by the average rotation, then per key the softmax
    over the non-sinks of mu.k s + k'Sigma k s^2 / 2, averaged per GQA group, times ||v||."""
    dim, n_q = 2 * half, n_kv * group
    queries = random((n_batch, n_q, window, dim), seed)
    keys = random((n_batch, n_kv, n, dim), seed + 1)
    values = random((n_batch, n_kv, n, dim), seed + 2)
    positions = list(range(3, 3 + window))
    rope = RoPE(500.0, dim, traditional, 1.0)
    start, n_future, scale, epsilon = 3 + window, 5, 1 / math.sqrt(dim), 0.05
    stats = query_stats(
        mx.array(queries),
        mx.array(positions),
        n_sink=n_sink + 3,
        rope=rope,
        start=start,
        n_future=n_future,
        use_covariance=use_covariance,
    )
    counted = np.arange(n) >= n_sink  # the first n_sink keys play the sinks
    counted_mx = mx.broadcast_to(mx.array(counted), (n_batch, n_kv, n))
    got = expected_scores(
        stats,
        mx.array(keys),
        mx.array(values),
        scale=scale,
        counted=counted_mx,
        use_vnorm=use_vnorm,
        epsilon=epsilon,
    )

    spec = {"base": 500.0, "dims": dim, "traditional": traditional, "scale": 1.0}
    mean, cov = reference_stats(queries, positions, n_sink + 3, spec, start, n_future)
    mean = mean[..., 0]
    np.testing.assert_allclose(np.array(stats.mean), mean, rtol=1e-4, atol=1e-5)
    if use_covariance:
        assert stats.cov is not None
        np.testing.assert_allclose(np.array(stats.cov), cov, rtol=1e-4, atol=1e-5)
    else:
        assert stats.cov is None
    k, v = keys.astype(np.float64), values.astype(np.float64)
    want = np.zeros((n_batch, n_kv, n))
    counted = counted if counted.any() else np.ones(n, bool)
    for b in range(n_batch):
        for h in range(n_kv):
            for qh in range(h * group, (h + 1) * group):
                logits = scale * k[b, h] @ mean[b, qh]
                if use_covariance:
                    logits += scale**2 * np.einsum("ni,ij,nj->n", k[b, h], cov[b, qh], k[b, h]) / 2
                top = logits[counted].max()
                norm = top + np.log(np.exp(logits[counted] - top).sum())
                want[b, h] += np.exp(logits - norm) / group
            if use_vnorm:
                want[b, h] = (want[b, h] + epsilon) * np.linalg.norm(v[b, h], axis=-1)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-4, atol=1e-6)


def test_zero_statistics_without_a_counted_query() -> None:
    """Queries all at sink positions: zero mean and covariance, so every key weighs the same."""
    stats = query_stats(
        mx.array(random((1, 2, 3, 4), 0)),
        mx.array([0, 1, 2]),
        n_sink=4,
        rope=RoPE(1e4, 4, False, 1.0),
        start=3,
        n_future=8,
    )
    assert (
        not np.array(stats.mean).any() and stats.cov is not None and not np.array(stats.cov).any()
    )
    scores = expected_scores(
        stats, mx.array(random((1, 2, 5, 4), 1)), mx.ones((1, 2, 5, 4)), scale=0.5
    )
    np.testing.assert_allclose(np.array(scores), 0.2 * 2.0, rtol=1e-6)


# ----------------------------------------------------------------------- the whole policy


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(2, 10))
    n_sink = draw(st.integers(0, budget - 1))
    return {
        "settings": {
            "budget": budget,
            "n_sink": n_sink,
            "recent": draw(st.integers(0, budget - n_sink - 1)),
            "n_queries": draw(st.integers(1, 8)),
            "refresh_every": draw(st.integers(1, 6)),
            "n_future": draw(st.integers(1, 32)),
            "use_covariance": draw(st.booleans()),
            "use_vnorm": draw(st.booleans()),
            "rope_base": draw(st.sampled_from((10.0, 1e4))),
            "rope_traditional": draw(st.booleans()),
        },
        "shape": (
            draw(st.integers(1, 2)),  # batch
            draw(st.integers(1, 3)),  # KV heads
            draw(st.integers(1, 4)),  # GQA ratio
            2 * draw(st.integers(2, 5)),  # head dim
        ),
        "prompt": draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)),
        "decode": draw(st.integers(1, 24)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@EXAMPLES
@given(run=runs())
def test_token_by_token_matches_reference(run: dict[str, Any]) -> None:
    """A prompt in chunks, its cut, then one token at a time across several refreshes: the
    kept positions (and rows, attention outputs, scores) equal the float64 reference's after
    every call."""
    state = POLICY.init(**run["settings"])
    ref = ReferenceExpectedAttention(**state.settings)
    length = sum(run["prompt"])
    stream = harness.make_stream(*run["shape"], length + run["decode"], run["seed"])
    state = harness.run_stream(POLICY.update, state, ref, stream, run["prompt"])
    state = expected_attention_compress(state)
    ref.compress()
    assume(ref.min_margin > harness.MIN_MARGIN)
    harness.check_state(state, ref, length)
    steps = []

    def after_call(step: Any, ref: Any, before: Any) -> None:
        steps.append(step.state.steps)
        assert step.state.n_kept == min(step.state.offset, state.budget)
        kept = np.array(step.state.positions)
        assert (kept[..., None] == np.arange(min(state.n_sink, step.state.offset))).any(-2).all()

    harness.run_stream(
        POLICY.update,
        state,
        ref,
        stream,
        [1] * run["decode"],
        start=length,
        after_call=after_call,
    )
    every = run["settings"]["refresh_every"]
    assert steps == [(i + 1) % every for i in range(run["decode"])]


@pytest.mark.parametrize("recent", [0, 3])
def test_decode_keeps_the_recent_window_as_the_reference_does(recent: int) -> None:
    """A fixed stream, cut at its prompt's end, then 30 tokens one at a time and a chunk of 5:
    kept positions, rows, outputs and scores equal the float64 reference's after every call, and
    the ``recent`` newest positions (past the prompt, which is cut by score alone) are kept."""
    settings = {"budget": 8, "n_sink": 2, "recent": recent, "n_queries": 5, "refresh_every": 4}
    state = POLICY.init(**settings, **ROPE)
    ref = ReferenceExpectedAttention(**state.settings)
    stream = harness.make_stream(1, 2, 2, 8, 55, seed=11)
    state = harness.run_stream(POLICY.update, state, ref, stream, [12, 8], close_call=_clear)
    state = expected_attention_compress(state)
    ref.compress()
    _clear(ref.min_margin > harness.MIN_MARGIN)
    harness.check_state(state, ref, 20)

    def after_call(step: Any, ref: Any, before: Any) -> None:
        newest = np.arange(max(20, step.state.offset - recent), step.state.offset)  # past the cut
        kept = np.array(step.state.positions)
        assert (kept[..., None] == newest).any(-2).all()

    chunks = [1] * 30 + [5]
    harness.run_stream(
        POLICY.update,
        state,
        ref,
        stream,
        chunks,
        start=20,
        close_call=_clear,
        after_call=after_call,
    )


def _clear(clear: bool) -> None:
    assert clear, "two scores too close to call: pick another seed"


def test_the_recent_window_spares_what_the_scores_would_evict() -> None:
    """The same stream with and without the window: without it some of the newest tokens go
    (a new key scores low against statistics of older queries), with it none does."""
    stream = [mx.array(x) for x in harness.make_stream(1, 2, 2, 8, 60, seed=12)]
    keys, values, queries = stream

    def newest_kept(recent: int) -> int:
        state = POLICY.init(budget=10, n_sink=2, recent=recent, refresh_every=8, **ROPE)
        state = POLICY.update(state, keys[:, :, :30], values[:, :, :30], queries[:, :, :30]).state
        state = POLICY.end_prompt(state)
        for t in range(30, 60):
            part = slice(t, t + 1)
            state = POLICY.update(
                state, keys[:, :, part], values[:, :, part], queries[:, :, part]
            ).state
        kept = np.array(state.positions)
        return int(min(((kept >= 56).sum(-1)).min(), 4))

    assert newest_kept(4) == 4
    assert newest_kept(0) < 4


def test_recent_defaults_to_16_within_the_budget() -> None:
    assert POLICY.init().recent == 16
    assert POLICY.init(budget=8, n_sink=4).recent == 3
    assert POLICY.init(budget=1, n_sink=0).recent == 0


def test_statistics_change_only_at_a_refresh() -> None:
    keys, values, queries = (mx.array(x) for x in harness.make_stream(1, 2, 2, 8, 40, seed=3))
    state = POLICY.init(budget=8, n_sink=2, n_queries=6, refresh_every=4, **ROPE)
    state = POLICY.update(state, keys[:, :, :20], values[:, :, :20], queries[:, :, :20]).state
    state = POLICY.end_prompt(state)
    means = [np.array(state.mean)]
    for t in range(20, 32):
        part = slice(t, t + 1)
        state = POLICY.update(
            state, keys[:, :, part], values[:, :, part], queries[:, :, part]
        ).state
        means.append(np.array(state.mean))
    changed = [not np.array_equal(a, b) for a, b in itertools.pairwise(means)]
    assert changed == [i % 4 == 3 for i in range(12)]
    assert np.array(state.queries.positions).tolist() == list(range(26, 32))


def test_compress_keeps_the_highest_expected_scores() -> None:
    """The cut keeps the sinks and, per KV head, the best scores expected_scores gives."""
    keys, values, queries = (mx.array(x) for x in harness.make_stream(2, 2, 3, 8, 30, seed=4))
    state = POLICY.init(budget=10, n_sink=3, n_queries=8, **ROPE)
    whole = POLICY.update(state, keys, values, queries).state
    cut = POLICY.end_prompt(whole)
    rope = whole.rope(8)
    stats = query_stats(
        whole.queries.probes, whole.queries.positions, n_sink=3, rope=rope, start=30, n_future=512
    )
    counted = mx.broadcast_to(mx.arange(30) >= 3, (2, 2, 30))
    scores = np.array(expected_scores(stats, keys, values, scale=1 / math.sqrt(8), counted=counted))
    for b in range(2):
        for h in range(2):
            best = np.argsort(-scores[b, h, 3:], kind="stable")[:7] + 3
            assert sorted(np.array(cut.positions)[b, h].tolist()) == [0, 1, 2, *sorted(best)]


def test_long_decode_stays_within_budget_and_keeps_sinks() -> None:
    keys, values, queries = (mx.array(x) for x in harness.make_stream(1, 2, 2, 8, 120, seed=5))
    state = POLICY.init(budget=12, n_sink=4, refresh_every=7, **ROPE)
    state = POLICY.end_prompt(
        POLICY.update(state, keys[:, :, :30], values[:, :, :30], queries[:, :, :30]).state
    )
    for t in range(30, 120):
        part = slice(t, t + 1)
        state = POLICY.update(
            state, keys[:, :, part], values[:, :, part], queries[:, :, part]
        ).state
        assert state.n_kept == 12
    kept = np.array(state.positions)
    assert all({0, 1, 2, 3} <= set(row.tolist()) for row in kept.reshape(-1, 12))
    assert state.scores.shape == state.slots.positions.shape


# --------------------------------------------------------------------------- refusals


def test_refuses_without_the_models_rope() -> None:
    """Nothing says how the queries were rotated: the first call names the settings."""
    keys, values, queries = (mx.array(x) for x in harness.make_stream(1, 1, 2, 8, 3, seed=6))
    state = POLICY.init(budget=8)
    with pytest.raises(ValueError, match="rope_base"):
        POLICY.update(state, keys, values, queries)
    no_rope = POLICY.update(POLICY.init(budget=8, rope_dims=0), keys, values, queries).state
    assert no_rope.offset == 3
    with pytest.raises(ValueError, match="rope_dims"):
        POLICY.update(POLICY.init(budget=8, rope_dims=10, **ROPE), keys, values, queries)
    odd = [mx.array(x) for x in harness.make_stream(1, 1, 2, 7, 3, seed=6)]
    with pytest.raises(ValueError, match="rope_dims"):
        POLICY.update(POLICY.init(budget=8, **ROPE), *odd)


def test_refuses_without_queries() -> None:
    keys, values, _ = (mx.array(x) for x in harness.make_stream(1, 1, 2, 8, 3, seed=7))
    with pytest.raises(ValueError, match="queries are required"):
        POLICY.update(POLICY.init(budget=8, **ROPE), keys, values)


def test_a_layer_the_hook_never_reaches_refuses() -> None:
    """No attend() came back with the queries: no key stand-in, a clear error, and the call
    stays pending (nothing half-applied)."""
    keys, values, _ = (mx.array(x) for x in harness.make_stream(1, 1, 2, 8, 4, seed=8))
    layer = Layer(POLICY, POLICY.init(budget=8, **ROPE), new_log(4))
    layer.lay_out(keys[:, :, :3], values[:, :, :3])
    with pytest.raises(ValueError, match=r"needs the true queries.*attention hook"):
        layer.lay_out(keys[:, :, 3:], values[:, :, 3:])
    assert layer.state.offset == 0
    with pytest.raises(ValueError, match="needs them"):
        Layer(POLICY, POLICY.init(budget=8, **ROPE), None, mode=Mode.AT_ONCE)


BAD_SETTINGS: list[tuple[str, Any, type[Exception], str]] = [
    ("budget", 0, ValueError, ">= 1"),
    ("budget", 2.0, TypeError, "an int >= 1"),
    ("n_sink", 8, ValueError, "< budget"),
    ("n_sink", -1, ValueError, ">= 0"),
    ("recent", 4, ValueError, "< budget - n_sink (4)"),
    ("recent", -1, ValueError, ">= 0"),
    ("recent", 2.0, TypeError, "an int >= 0"),
    ("n_queries", 0, ValueError, ">= 1"),
    ("n_queries", "128", TypeError, "an int >= 1"),
    ("refresh_every", 0, ValueError, ">= 1"),
    ("refresh_every", 1.5, TypeError, "an int >= 1"),
    ("n_future", -4, ValueError, ">= 1"),
    ("n_future", None, TypeError, "an int >= 1"),
    ("use_covariance", "no", TypeError, "a bool"),
    ("use_vnorm", 0, TypeError, "a bool"),
    ("epsilon", -1e-3, ValueError, ">= 0.0"),
    ("epsilon", math.nan, ValueError, "finite"),
    ("epsilon", "0", TypeError, "a finite float"),
    ("rope_base", 1.0, ValueError, "> 1.0"),
    ("rope_base", math.inf, ValueError, "finite"),
    ("rope_base", [1e4], TypeError, "a finite float"),
    ("rope_dims", 5, ValueError, "even"),
    ("rope_dims", -2, ValueError, ">= 0"),
    ("rope_dims", 4.0, TypeError, "an int >= 0"),
    ("rope_traditional", "false", TypeError, "a bool"),
    ("rope_scale", 0.0, ValueError, "> 0.0"),
    ("rope_scale", "1", TypeError, "a finite float"),
    ("allocation", "layer", ValueError, "['uniform', 'head', 'global']"),
    ("allocation_floor", 1.5, ValueError, "[0, 1]"),
    ("allocation_floor", "0.2", TypeError, "a float in [0, 1]"),
]


@pytest.mark.parametrize(("name", "value", "error", "range_"), BAD_SETTINGS)
def test_bad_setting_names_the_parameter_and_its_range(
    name: str, value: Any, error: type[Exception], range_: str
) -> None:
    with pytest.raises(error) as info:
        POLICY.init(**{"budget": 8, name: value})
    assert name in str(info.value) and range_ in str(info.value), str(info.value)


def test_every_setting_has_a_bad_input_test() -> None:
    assert {name for name, *_ in BAD_SETTINGS} == set(POLICY.setting_names)
