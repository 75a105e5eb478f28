"""``engine.prepare`` + ``engine.decide`` are ``engine.update`` in two halves (tensor-parallel
decode decides a laid-out call a second time once its sums arrive): the same step, and deciding
one laid-out call twice gives the same step again."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from velox_cache_core import POLICIES
from velox_cache_core.engine import decide, prepare, update
from velox_cache_core.undo import new_log

TOVA = POLICIES["tova"]


def _full_state(budget: int = 8, steps: int = 12) -> tuple[Any, Any]:
    """A TOVA state past its budget (so it holds a dead slot) and an undo log."""
    mx.random.seed(3)
    state, log = TOVA.init(budget=budget, n_sink=1), new_log(4)
    for _ in range(steps):
        k, v = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
        q = mx.random.normal((1, 4, 1, 8))
        step = update(TOVA, state, k, v, q, log=log)
        state, log = step.state, step.log
    assert state.slots.free is not None
    return state, log


def _same(a: Any, b: Any) -> bool:
    return all(
        mx.array_equal(x, y) for x, y in zip(a.slots.arrays(), b.slots.arrays(), strict=True)
    )


def test_halves_equal_update() -> None:
    state, log = _full_state()
    k, v = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
    q = mx.random.normal((1, 4, 1, 8))
    whole = update(TOVA, state, k, v, q, log=log)
    laid = prepare(TOVA, state, k, v, q)
    halves = decide(TOVA, laid, log)
    again = decide(TOVA, laid, log)  # the same laid-out call decided twice
    for step in (halves, again):
        assert _same(step.state, whole.state) and step.state.offset == whole.state.offset
        assert mx.array_equal(step.probs, whole.probs)
        assert step.log.tokens == whole.log.tokens


def test_prepare_refuses_an_empty_call() -> None:
    state, _ = _full_state()
    k = mx.random.normal((1, 2, 0, 8))
    q = mx.random.normal((1, 4, 0, 8))
    with pytest.raises(ValueError, match="at least one new token"):
        prepare(TOVA, state, k, k, q)
