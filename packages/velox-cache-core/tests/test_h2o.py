"""What is special to H2O: running attention sums (inertial, unlike TOVA), sinks and a protected
recent window. Agreement with the numpy reference (core_reference_siblings.ReferenceH2O, running
scores included), chunk invariance and the shared guarantees are in test_policy_contract.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_harness import make_stream, state_positions
from core_reference import ReferenceTova
from core_reference_siblings import ReferenceH2O

from velox_cache_core import H2OState, h2o_update, init_h2o_state


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
    keys, values, queries = make_stream(1, 2, 2, 4, 12, seed=1)
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
    assert 1 in state_positions(state)[0][0]
    assert state_positions(state) == ref.positions()
    tova = ReferenceTova(3, 0, "query", "head", "sequential")
    tova.feed(keys, keys, queries, scale=1.0)
    assert tova.positions() == [[[2, 3, 4]]]  # memoryless TOVA lets it go


@pytest.mark.parametrize("prefill", ("sequential", "oneshot"))
def test_recent_window_is_never_evicted(prefill) -> None:
    keys, values, queries = make_stream(1, 2, 2, 8, 20, seed=3)
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
        for row in state_positions(state)[0]:
            assert {0, 1} <= set(row)
            assert set(range(max(0, newest - 2), newest + 1)) <= set(row)


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
