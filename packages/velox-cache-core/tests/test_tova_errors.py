"""Bad arguments to the TOVA engine raise errors that name the argument and change nothing."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import init_tova_state, tova_update

B, H, GROUP, D = 2, 2, 2, 8


def arrays(n: int, b: int = B, h: int = H, d: int = D, group: int = GROUP, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32))
    values = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32))
    queries = mx.array(rng.standard_normal((b, h * group, n, d)).astype(np.float32))
    return keys, values, queries


@pytest.fixture(params=["query", "key"])
def state(request):
    """A state past its budget, so that a failed call would have something to break."""
    fresh = init_tova_state(budget=4, n_sink=1, signal=request.param)
    keys, values, queries = arrays(6)
    return tova_update(fresh, keys, values, queries=queries).state


def snapshot(state) -> dict:
    return {
        "positions": np.array(state.positions),
        "keys": np.array(state.keys),
        "values": np.array(state.values),
        "offset": state.offset,
        "tokens_seen": state.tokens_seen,
        "n_kept": state.n_kept,
    }


def assert_rejected(state, name: str, *args, error=(ValueError, TypeError), **kwargs) -> None:
    """tova_update(state, *args, **kwargs) raises, names `name`, and leaves `state` as it was."""
    before = snapshot(state)
    with pytest.raises(error) as info:
        tova_update(state, *args, **kwargs)
    assert name in str(info.value), f"message does not name {name!r}: {info.value}"
    after = snapshot(state)
    for key, want in before.items():
        np.testing.assert_array_equal(after[key], want, err_msg=key)


# ------------------------------------------------------------------------------ shapes


def test_wrong_rank(state) -> None:
    keys, values, queries = arrays(1)
    assert_rejected(state, "keys", keys[:, :, 0], values, queries=queries)
    assert_rejected(state, "values", keys, values[0], queries=queries)
    assert_rejected(state, "queries", keys, values, queries=queries[:, :, 0])


def test_keys_values_shape_mismatch(state) -> None:
    keys, values, queries = arrays(3)
    assert_rejected(state, "values", keys, values[:, :, :2], queries=queries)
    assert_rejected(state, "values", keys, values[..., :4], queries=queries)
    assert_rejected(state, "values", keys, values[:1], queries=queries)


def test_keys_values_dtype_mismatch(state) -> None:
    keys, values, queries = arrays(3)
    assert_rejected(state, "values", keys, values.astype(mx.float16), queries=queries)


def test_head_dim_differs_from_state(state) -> None:
    keys, values, queries = arrays(1, d=4)
    assert_rejected(state, "keys", keys, values, queries=queries)


def test_batch_or_heads_change_after_init(state) -> None:
    keys, values, queries = arrays(1, b=3)
    assert_rejected(state, "keys", keys, values, queries=queries)
    keys, values, queries = arrays(1, h=1, group=4)
    assert_rejected(state, "keys", keys, values, queries=queries)


def test_queries_heads_not_a_multiple(state) -> None:
    keys, values, _ = arrays(2)
    queries = arrays(2, h=3, group=1)[2]
    assert_rejected(state, "queries", keys, values, queries=queries)


def test_queries_length_or_dim_mismatch(state) -> None:
    keys, values, queries = arrays(3)
    assert_rejected(state, "queries", keys, values, queries=queries[:, :, :2])
    assert_rejected(state, "queries", keys, values, queries=queries[..., :4])
    assert_rejected(state, "queries", keys, values, queries=queries[:1])


def test_query_signal_needs_queries() -> None:
    keys, values, queries = arrays(3)
    state = tova_update(
        init_tova_state(budget=4, n_sink=1, signal="query"), keys, values, queries=queries
    ).state
    assert_rejected(state, "queries", keys, values)
    assert_rejected(init_tova_state(budget=4, n_sink=1, signal="query"), "queries", keys, values)


# ------------------------------------------------------------------------------ values


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_keys(state, bad) -> None:
    keys, values, queries = arrays(3)
    broken = np.array(keys)
    broken[1, 0, 2, 3] = bad
    assert_rejected(state, "keys", mx.array(broken), values, queries=queries)


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf])
def test_bad_scale(state, scale) -> None:
    keys, values, queries = arrays(2)
    assert_rejected(state, "scale", keys, values, queries=queries, scale=scale)


# ------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(("budget", "n_sink"), [(4, 4), (4, 5), (1, 1), (4, -1)])
def test_bad_n_sink(budget, n_sink) -> None:
    with pytest.raises(ValueError, match="n_sink"):
        init_tova_state(budget=budget, n_sink=n_sink)


@pytest.mark.parametrize("budget", [0, -3])
def test_non_positive_budget(budget) -> None:
    with pytest.raises(ValueError, match="budget"):
        init_tova_state(budget=budget, n_sink=0)


@pytest.mark.parametrize("budget", [8.0, "8", None])
def test_non_int_budget(budget) -> None:
    with pytest.raises(TypeError, match="budget"):
        init_tova_state(budget=budget, n_sink=0)


@pytest.mark.parametrize("name", ["signal", "scope", "prefill", "preset"])
def test_unknown_setting(name) -> None:
    with pytest.raises(ValueError, match=name):
        init_tova_state(budget=8, n_sink=1, **{name: "bogus"})


def test_zero_sinks_allowed() -> None:
    assert init_tova_state(budget=1, n_sink=0).n_sink == 0
