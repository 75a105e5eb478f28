"""H2O against the numpy reference (reference_siblings.ReferenceH2O): running attention sums,
sinks and a protected recent window; what is special to H2O beyond the shared contract."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from velox_cache_core import H2OState, h2o_update, init_h2o_state

support = sys.modules["velox_core_tests"]  # loaded by conftest.py

helpers = support.helpers
harness = support.sibling_harness
ReferenceH2O = support.reference_siblings.ReferenceH2O

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def check_scores(step, ref) -> None:
    """state.scores [B, G, S] is slot-aligned: each live slot holds its position's running sum."""
    state = step.state
    if state.n_kept == 0:
        return
    scores = np.array(state.scores)
    G = scores.shape[1]
    assert (1 if ref.scope == "layer" else ref.n_kv) == G
    positions = np.array(state.slots.positions)[:, :G]
    free = None if state.slots.free is None else np.array(state.slots.free)[:, :G]
    assert scores.shape[2] == positions.shape[2]
    for b in range(scores.shape[0]):
        for g in range(G):
            for s in range(scores.shape[2]):
                if free is not None and free[b, g] == s:
                    continue
                want = ref.scores[b][g][int(positions[b, g, s])]
                np.testing.assert_allclose(scores[b, g, s], want, rtol=1e-4, atol=1e-5)


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    budget = draw(st.integers(1, 10))
    n_sink = draw(st.integers(0, budget - 1))
    signal = draw(st.sampled_from(("query", "key")))
    return {
        "shape": draw(harness.shapes()),
        "options": {
            "budget": budget,
            "n_sink": n_sink,
            "recent": draw(st.integers(0, budget - n_sink)),
            "signal": signal,
            "scope": draw(st.sampled_from(("layer", "head"))),
            "prefill": draw(st.sampled_from(("sequential", "oneshot"))),
        },
        "give_queries": signal == "query" or draw(st.booleans()),
        "scale": draw(st.sampled_from([None, None, 0.5])),
        "chunks": draw(harness.chunk_sizes()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def run_scenario(scn: dict, close_call=assume) -> None:
    stream = harness.make_stream(*scn["shape"], sum(scn["chunks"]), scn["seed"])
    harness.run_stream(
        helpers,
        h2o_update,
        init_h2o_state(**scn["options"]),
        ReferenceH2O(**scn["options"]),
        stream,
        scn["chunks"],
        give_queries=scn["give_queries"],
        scale=scn["scale"],
        close_call=close_call,
        after_call=check_scores,
    )


@SETTINGS
@given(scenarios())
def test_engine_matches_reference(scn: dict) -> None:
    run_scenario(scn)


@pytest.mark.parametrize("prefill", ("sequential", "oneshot"))
@pytest.mark.parametrize("scope", ("layer", "head"))
@pytest.mark.parametrize("signal", ("query", "key"))
def test_engine_matches_reference_every_combination(signal, scope, prefill) -> None:
    # Fixed, eviction-heavy streams so every combination runs whatever hypothesis draws.
    for seed, chunks in enumerate([[1] * 16, [7, 0, 1, 6, 3], [16], [4, 4, 4, 4]]):
        run_scenario(
            {
                "shape": (2, 2, 2, 8),
                "options": {
                    "budget": 6,
                    "n_sink": 1,
                    "recent": 2,
                    "signal": signal,
                    "scope": scope,
                    "prefill": prefill,
                },
                "give_queries": seed % 2 == 0 or signal == "query",
                "scale": None,
                "chunks": chunks,
                "seed": 2000 + seed,
            },
            close_call=harness.assert_clear,
        )


@SETTINGS
@given(
    splits=harness.two_splits(),
    budget=st.integers(1, 10),
    fractions=st.tuples(st.floats(0, 0.99), st.floats(0, 1)),
    signal=st.sampled_from(("query", "key")),
    scope=st.sampled_from(("layer", "head")),
    shape=harness.shapes(),
    seed=st.integers(0, 2**31 - 1),
)
def test_sequential_is_chunk_invariant(splits, budget, fractions, signal, scope, shape, seed):
    length, split_a, split_b = splits
    n_sink = int(fractions[0] * budget)
    options = {
        "budget": budget,
        "n_sink": n_sink,
        "recent": int(fractions[1] * (budget - n_sink)),
        "signal": signal,
        "scope": scope,
        "prefill": "sequential",
    }
    stream = harness.make_stream(*shape, length, seed)
    ref = ReferenceH2O(**options)
    ref.feed(*stream)
    assume(ref.min_margin > harness.MIN_MARGIN)
    state_a, out_a = harness.run_engine(
        h2o_update, init_h2o_state(**options), stream, split_a, helpers
    )
    state_b, out_b = harness.run_engine(
        h2o_update, init_h2o_state(**options), stream, split_b, helpers
    )
    harness.assert_same_states(helpers, state_a, state_b)
    assert helpers.state_positions(state_a) == (ref.positions() if length else None)
    np.testing.assert_allclose(out_a, out_b, atol=harness.ATOL, rtol=harness.RTOL)


# ------------------------------------------------------------------ what H2O alone does


def test_defaults_and_scores_field() -> None:
    state = init_h2o_state(budget=8)
    assert isinstance(state, H2OState)
    assert (state.n_sink, state.recent, state.signal, state.scope, state.prefill) == (
        4,
        4,
        "query",
        "head",
        "sequential",
    )
    assert state.settings["recent"] == 4
    keys, values, queries = harness.make_stream(1, 2, 2, 4, 12, seed=1)
    step = h2o_update(state, mx.array(keys), mx.array(values), mx.array(queries))
    assert step.state.scores.dtype == mx.float32
    assert step.state.scores.shape[:2] == (1, 2)


def test_inertial_not_memoryless() -> None:
    # TOVA forgets; H2O remembers: a token that was attended heavily early survives a later
    # step in which it is ignored, as long as its running sum stays above the others'.
    d = 4
    keys = np.zeros((1, 1, 5, d), dtype=np.float32)
    keys[0, 0, 1, 0] = 6.0  # position 1: the early heavy hitter
    keys[0, 0, 2, 1] = 0.5
    keys[0, 0, 3, 2] = 0.5
    keys[0, 0, 4, 3] = 0.5
    queries = np.zeros((1, 1, 5, d), dtype=np.float32)
    queries[0, 0, :4, 0] = 1.0  # early queries look at position 1
    queries[0, 0, 4, 1] = 3.0  # the last looks elsewhere
    options = {"budget": 3, "n_sink": 0, "recent": 0, "signal": "query", "scope": "head"}
    ref = ReferenceH2O(**options, prefill="sequential")
    ref.feed(keys, keys, queries, scale=1.0)
    state = init_h2o_state(**options)
    for i in range(5):
        part = slice(i, i + 1)
        state = h2o_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(keys[:, :, part]),
            mx.array(queries[:, :, part]),
            scale=1.0,
        ).state
    assert 1 in helpers.state_positions(state)[0][0]
    assert helpers.state_positions(state) == ref.positions()
    tova = support.reference.ReferenceTova(3, 0, "query", "head", "sequential")
    tova.feed(keys, keys, queries, scale=1.0)
    assert tova.positions() == [[[2, 3, 4]]]  # memoryless TOVA lets it go


@pytest.mark.parametrize("prefill", ("sequential", "oneshot"))
def test_recent_window_is_never_evicted(prefill) -> None:
    keys, values, queries = harness.make_stream(1, 2, 2, 8, 20, seed=3)
    state = init_h2o_state(budget=7, n_sink=2, recent=3, prefill=prefill)
    for size in (5, 1, 1, 6, 1, 4, 2):
        start = state.offset
        part = slice(start, start + size)
        state = h2o_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            mx.array(queries[:, :, part]),
        ).state
        newest = state.offset - 1
        for row in helpers.state_positions(state)[0]:
            assert {0, 1} <= set(row)
            assert set(range(max(0, newest - 2), newest + 1)) <= set(row)


def test_recent_must_leave_room() -> None:
    with pytest.raises(ValueError, match="recent"):
        init_h2o_state(budget=8, n_sink=4, recent=5)
    init_h2o_state(budget=8, n_sink=4, recent=4)
    with pytest.raises(ValueError, match="recent"):
        init_h2o_state(budget=8, n_sink=0, recent=-1)


def test_reference_by_hand() -> None:
    # budget 2, no sinks, no recent window, key signal: at t=2 the running sums decide.
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])[None, None]
    ref = ReferenceH2O(2, 0, 0, "key", "head", "sequential")
    ref.feed(keys, keys, scale=1.0)
    # t=1: both candidates attended by k1: p0 e^0, p1 e^1. t=2: k2 scores p0 e^3, p1 e^0, p2 e^9.
    w1 = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    w2 = np.exp([3.0, 0.0, 9.0]) / np.exp([3.0, 0.0, 9.0]).sum()
    sums = [1.0 + w1[0] + w2[0], w1[1] + w2[1], w2[2]]
    assert sums[1] < sums[0] and sums[1] < sums[2]
    assert ref.positions() == [[[0, 2]]]
    np.testing.assert_allclose(ref.scores[0][0][0], sums[0])
    np.testing.assert_allclose(ref.scores[0][0][2], sums[2])
