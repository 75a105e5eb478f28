"""Seed-level guarantees of the TOVA engine (docs/architecture.md section 3), for every setting."""

from __future__ import annotations

import dataclasses
import itertools

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import TovaState, TovaStep, init_tova_state, tova_update

COMBINATIONS = list(
    itertools.product(("query", "key"), ("layer", "head"), ("sequential", "oneshot"))
)
IDS = ["-".join(c) for c in COMBINATIONS]


def settings(combination: tuple[str, str, str]) -> dict[str, str]:
    signal, scope, prefill = combination
    return {"signal": signal, "scope": scope, "prefill": prefill}


def stream(b=1, h=2, n=10, d=8, group=2, seed=0, dtype=np.float32):
    """Random keys, values [b, h, n, d] and queries [b, h * group, n, d] as numpy arrays."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((b, h, n, d)).astype(dtype)
    values = rng.standard_normal((b, h, n, d)).astype(dtype)
    queries = rng.standard_normal((b, h * group, n, d)).astype(dtype)
    return keys, values, queries


def feed(state, keys, values, queries, chunks):
    """Feed the numpy stream in chunks of the given sizes; returns the list of steps."""
    steps, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        step = tova_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            queries=mx.array(queries[:, :, part]),
        )
        steps.append(step)
        state = step.state
        start += size
    return steps


def kept(state) -> list[list[list[int]]]:
    return [[sorted(int(p) for p in row) for row in rows] for rows in np.array(state.positions)]


def sorted_rows(state):
    positions = np.array(state.positions).astype(np.int64)
    order = np.argsort(positions, axis=-1)
    keys = np.take_along_axis(np.array(state.keys), order[..., None], axis=2)
    values = np.take_along_axis(np.array(state.values), order[..., None], axis=2)
    return np.take_along_axis(positions, order, axis=-1), keys, values


# ------------------------------------------------------------------------ state shape


def test_state_has_no_scores() -> None:
    state = init_tova_state(budget=4, n_sink=1)
    assert isinstance(state, TovaState)
    assert not hasattr(state, "scores")
    assert "scores" not in {f.name for f in dataclasses.fields(state)}
    keys, values, queries = stream(n=6)
    step = feed(state, keys, values, queries, [6])[0]
    assert isinstance(step, TovaStep)
    assert not hasattr(step.state, "scores")


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_empty_call_on_fresh_state(combination) -> None:
    state = init_tova_state(budget=4, n_sink=1, **settings(combination))
    assert state.n_kept == 0 and state.offset == 0 and state.tokens_seen == 0
    assert state.compression_ratio == 1.0
    keys, values, queries = stream(b=2, h=3, n=0, d=5)
    step = feed(state, keys, values, queries, [0])[0]
    assert step.keys.shape == (2, 3, 0, 5)
    assert step.values.shape == (2, 3, 0, 5)
    assert step.state.n_kept == 0 and step.state.offset == 0 and step.state.tokens_seen == 0


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_one_token_bootstraps(combination) -> None:
    keys, values, queries = stream(b=2, h=2, n=1, d=4)
    step = feed(
        init_tova_state(budget=3, n_sink=1, **settings(combination)), keys, values, queries, [1]
    )[0]
    assert step.mask is None or bool(np.array(step.mask).all())
    np.testing.assert_array_equal(np.array(step.keys), keys)
    np.testing.assert_array_equal(np.array(step.values), values)
    state = step.state
    assert state.n_kept == 1 and state.offset == 1
    assert kept(state) == [[[0], [0]], [[0], [0]]]
    np.testing.assert_array_equal(np.array(state.keys), keys)
    np.testing.assert_array_equal(np.array(state.values), values)


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("chunks", [[6], [1] * 6, [2, 0, 3, 1]])
def test_below_budget_keeps_everything(combination, chunks) -> None:
    keys, values, queries = stream(n=6)
    state = feed(
        init_tova_state(budget=6, n_sink=2, **settings(combination)), keys, values, queries, chunks
    )[-1].state
    assert state.n_kept == 6
    assert kept(state) == [[list(range(6))] * 2]
    _, stored_keys, stored_values = sorted_rows(state)
    np.testing.assert_array_equal(stored_keys, keys)
    np.testing.assert_array_equal(stored_values, values)
    assert state.compression_ratio == 1.0


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_budget_never_exceeded_over_decode(combination) -> None:
    keys, values, queries = stream(b=2, n=30, seed=1)
    state = init_tova_state(budget=5, n_sink=2, **settings(combination))
    for t, step in enumerate(feed(state, keys, values, queries, [1] * 30)):
        state = step.state
        assert state.n_kept == min(t + 1, 5)
        assert state.keys.shape == state.values.shape == (2, 2, state.n_kept, 8)
        assert state.positions.shape == (2, 2, state.n_kept)
        assert step.keys.shape == step.values.shape
        assert state.offset == t + 1


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("chunks", [[6], [1] * 6, [5, 1], [3, 3]])
def test_budget_plus_one_leaves_budget(combination, chunks) -> None:
    keys, values, queries = stream(n=6, seed=2)
    state = feed(
        init_tova_state(budget=5, n_sink=1, **settings(combination)), keys, values, queries, chunks
    )[-1].state
    assert state.n_kept == 5
    assert state.keys.shape == state.values.shape == (1, 2, 5, 8)
    for row in kept(state)[0]:
        assert len(set(row)) == 5 and set(row) <= set(range(6))


# ---------------------------------------------------------------------------- sinks


def hostile_sink_stream(n: int, n_sink: int, b=1, h=2, group=2, d=8):
    """Streams where the first n_sink tokens would be the first evicted if they were not sinks.

    Every key and query is close to +1 (large positive logits), except the sink keys, which point
    the other way: their weight is the lowest under both signals.
    """
    keys, values, queries = stream(b=b, h=h, n=n, d=d, group=group, seed=3)
    keys = 0.1 * keys + 1.0
    queries = 0.1 * queries + 1.0
    keys[:, :, :n_sink] = -1.0 - 0.01 * np.arange(n_sink)[:, None]
    return keys, values, queries


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("chunks", [[1] * 30, [7, 1, 9, 13]])
def test_sinks_survive_every_eviction(combination, chunks) -> None:
    keys, values, queries = hostile_sink_stream(30, n_sink=3)
    state = init_tova_state(budget=6, n_sink=3, **settings(combination))
    for step in feed(state, keys, values, queries, chunks):
        sinks = list(range(min(3, step.state.offset)))
        for row in kept(step.state)[0]:
            assert row[: len(sinks)] == sinks


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_no_sinks_lets_early_tokens_go(combination) -> None:
    keys, values, queries = hostile_sink_stream(20, n_sink=3)
    state = init_tova_state(budget=6, n_sink=0, **settings(combination))
    state = feed(state, keys, values, queries, [1] * 20)[-1].state
    assert state.n_kept == 6
    for row in kept(state)[0]:
        assert not {0, 1, 2} & set(row)


# --------------------------------------------------------------------------- decisions


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_key_signal_evicts_orthogonal_before_aligned(scope) -> None:
    # Budget 2: the incoming key [3, 0] aligns with k0 = [1, 0] and ignores k1 = [0, 1].
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]], dtype=np.float32)[None, None]
    values = np.zeros_like(keys)
    state = init_tova_state(budget=2, n_sink=0, signal="key", scope=scope)
    for t in range(3):
        state = tova_update(
            state, mx.array(keys[:, :, t : t + 1]), mx.array(values[:, :, t : t + 1])
        ).state
    assert kept(state) == [[[0, 2]]]


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("chunks", [[1] * 12, [12], [5, 7]])
def test_equal_weights_evict_lowest_position(combination, chunks) -> None:
    # Identical keys and queries tie every weight: TOVA then slides a window behind the sinks.
    keys = np.ones((1, 2, 12, 4), dtype=np.float32)
    queries = np.ones((1, 4, 12, 4), dtype=np.float32)
    values = stream(n=12, d=4)[1]
    state = init_tova_state(budget=4, n_sink=1, **settings(combination))
    state = feed(state, keys, values, queries, chunks)[-1].state
    assert kept(state) == [[[0, 9, 10, 11]] * 2]


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_memoryless(combination) -> None:
    # Two histories that differ only in a token both evict: the next step must not tell them
    # apart (an accumulating score like H2O's would).
    keys, values, queries = hostile_sink_stream(9, n_sink=1)  # position 0 is the hostile one
    other_keys, other_values = keys.copy(), values.copy()
    other_keys[:, :, 0] = -2.0
    other_values[:, :, 0] = 7.0
    options = settings(combination)
    state_a = feed(init_tova_state(budget=4, n_sink=0, **options), keys, values, queries, [1] * 5)[
        -1
    ].state
    state_b = feed(
        init_tova_state(budget=4, n_sink=0, **options), other_keys, other_values, queries, [2, 3]
    )[-1].state
    assert kept(state_a) == kept(state_b) == [[[1, 2, 3, 4]] * 2]
    for got, want in zip(sorted_rows(state_a), sorted_rows(state_b), strict=True):
        np.testing.assert_array_equal(got, want)
    next_a = feed(state_a, keys[:, :, 5:], values[:, :, 5:], queries[:, :, 5:], [1, 3])
    next_b = feed(state_b, keys[:, :, 5:], values[:, :, 5:], queries[:, :, 5:], [1, 3])
    for step_a, step_b in zip(next_a, next_b, strict=True):
        assert kept(step_a.state) == kept(step_b.state)
        for got, want in zip(sorted_rows(step_a.state), sorted_rows(step_b.state), strict=True):
            np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------ accounting


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nbytes(dtype) -> None:
    keys, values, queries = stream(b=2, h=3, n=7, d=8, group=1, dtype=dtype)
    state = init_tova_state(budget=5, n_sink=1, signal="key")
    for step in feed(state, keys, values, queries, [3, 4]):
        itemsize = np.dtype(dtype).itemsize
        assert step.state.nbytes == 2 * 3 * step.state.n_kept * 8 * 2 * itemsize
    assert step.state.n_kept == 5


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_compression_ratio_and_tokens_seen(combination) -> None:
    keys, values, queries = stream(b=2, h=3, n=20, group=1)
    state = init_tova_state(budget=8, n_sink=2, **settings(combination))
    assert state.compression_ratio == 1.0 and state.tokens_seen == 0
    for step in feed(state, keys, values, queries, [3, 0, 5, 1, 1, 10]):
        state = step.state
        assert state.tokens_seen == 6 * state.offset
        if state.offset <= 8:
            assert state.compression_ratio == 1.0
        else:
            assert state.compression_ratio > 1.0
            assert state.compression_ratio == pytest.approx(state.offset / state.n_kept)
    assert state.offset == 20 and state.n_kept == 8
    assert state.compression_ratio == pytest.approx(2.5)


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_tokens_seen_accumulates_per_call(combination) -> None:
    keys, values, queries = stream(b=2, h=3, n=12, group=1)
    state = init_tova_state(budget=4, n_sink=0, **settings(combination))
    expected = 0
    start = 0
    for size in [5, 0, 1, 6]:
        state = feed(
            state, keys[:, :, start:], values[:, :, start:], queries[:, :, start:], [size]
        )[-1].state
        expected += 2 * 3 * size
        start += size
        assert state.tokens_seen == expected


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_update_leaves_input_state_untouched(combination) -> None:
    # Branching from one state twice gives the same result: an update never writes into it.
    keys, values, queries = stream(n=12, seed=6)
    state = feed(
        init_tova_state(budget=5, n_sink=1, **settings(combination)), keys, values, queries, [8]
    )[-1].state
    before = [np.array(state.positions), np.array(state.keys), np.array(state.values)]
    first = feed(state, keys[:, :, 8:], values[:, :, 8:], queries[:, :, 8:], [1, 1, 2])
    after = [np.array(state.positions), np.array(state.keys), np.array(state.values)]
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert state.offset == 8
    second = feed(state, keys[:, :, 8:], values[:, :, 8:], queries[:, :, 8:], [1, 1, 2])
    for step_a, step_b in zip(first, second, strict=True):
        for got, want in zip(sorted_rows(step_a.state), sorted_rows(step_b.state), strict=True):
            np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- positions


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("chunks", [[1] * 40, [13, 1, 0, 9, 17], [40]])
def test_positions_are_true_through_eviction(combination, chunks) -> None:
    # values[..., 0] encodes each token's position: the stored position must name the stored row.
    keys, values, queries = stream(b=2, n=40, seed=8)
    values[..., 0] = np.arange(40, dtype=np.float32)
    state = init_tova_state(budget=5, n_sink=2, **settings(combination))
    start = 0
    for step, size in zip(feed(state, keys, values, queries, chunks), chunks, strict=True):
        state = step.state
        start += size
        assert state.offset == start
        positions = np.array(state.positions)
        assert positions.dtype == np.int32
        assert positions.min() >= 0 and positions.max() < start
        np.testing.assert_array_equal(np.array(state.values)[..., 0], positions)
        stored_keys = np.array(state.keys)
        for b in range(2):
            for h in range(2):
                np.testing.assert_array_equal(stored_keys[b, h], keys[b, h, positions[b, h]])
        for row in positions.reshape(-1, positions.shape[-1]):
            assert len(set(row.tolist())) == len(row)
    assert state.offset == 40 and state.n_kept == 5


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_layer_scope_keeps_same_positions_in_every_head(combination) -> None:
    keys, values, queries = stream(b=2, h=3, n=20, seed=9)
    state = feed(
        init_tova_state(budget=4, n_sink=1, **settings(combination)),
        keys,
        values,
        queries,
        [7, 1, 12],
    )[-1].state
    for rows in kept(state):
        if combination[1] == "layer":
            assert all(row == rows[0] for row in rows)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
@pytest.mark.parametrize("give_queries", [True, False])
def test_mask_shape(combination, give_queries) -> None:
    signal, scope, _ = combination
    if signal == "query" and not give_queries:
        return
    keys, values, queries = stream(b=2, h=2, n=9, group=3)
    state = init_tova_state(budget=4, n_sink=1, **settings(combination))
    for size in (3, 1, 5):
        part = slice(state.offset, state.offset + size)
        step = tova_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            queries=mx.array(queries[:, :, part]) if give_queries else None,
        )
        n = state.n_kept + size
        assert step.keys.shape == (2, 2, n, 8)
        if size > 1:
            heads = 1 if scope == "layer" else (6 if give_queries else 2)
            assert step.mask is not None
            assert step.mask.dtype == mx.bool_
            assert step.mask.shape == (2, heads, size, n)
        elif step.mask is not None:
            assert bool(np.array(step.mask).all())
        state = step.state


# --------------------------------------------------------------------------- presets


def test_presets_and_overrides() -> None:
    def picked(state) -> tuple[str, str, str]:
        return state.signal, state.scope, state.prefill

    assert picked(init_tova_state(budget=8, n_sink=1)) == ("query", "layer", "sequential")
    assert picked(init_tova_state(budget=8, n_sink=1, preset="tova")) == (
        "query",
        "layer",
        "sequential",
    )
    assert picked(init_tova_state(budget=8, n_sink=1, preset="tova_adapted")) == (
        "key",
        "head",
        "sequential",
    )
    assert picked(init_tova_state(budget=8, n_sink=1, preset="tova", scope="head")) == (
        "query",
        "head",
        "sequential",
    )
    assert picked(
        init_tova_state(
            budget=8, n_sink=1, preset="tova_adapted", signal="query", prefill="oneshot"
        )
    ) == ("query", "head", "oneshot")
    state = init_tova_state(budget=8, n_sink=3)
    assert (state.budget, state.n_sink) == (8, 3)
    default = init_tova_state()
    assert (default.budget, default.n_sink) == (512, 4)
