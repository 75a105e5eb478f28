"""``engine.prepare`` + ``engine.decide`` are ``engine.update`` in two halves: the same step,
whether the candidates are laid out by ``prepare`` or handed in (``laid_out``), and deciding a
laid-out call twice does not change it."""

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


def test_halves_equal_update_with_and_without_laid_out() -> None:
    state, log = _full_state()
    k, v = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8))
    q = mx.random.normal((1, 4, 1, 8))
    whole = update(TOVA, state, k, v, q, log=log)
    laid = prepare(TOVA, state, k, v, q)
    halves = decide(TOVA, laid, log)
    handed = decide(
        TOVA,
        prepare(TOVA, state, k, v, q, laid_out=state.slots.write_free(k, v, state.offset)),
        log,
    )
    again = decide(TOVA, laid, log)  # the same laid-out call decided twice
    for step in (halves, handed, again):
        assert _same(step.state, whole.state) and step.state.offset == whole.state.offset
        assert mx.array_equal(step.probs, whole.probs)
        assert step.log.tokens == whole.log.tokens


def test_prepare_refuses_what_it_cannot_lay_out() -> None:
    state, _ = _full_state()
    k = mx.random.normal((1, 2, 3, 8))
    q = mx.random.normal((1, 4, 3, 8))
    with pytest.raises(ValueError, match="laid_out is only for one token"):
        prepare(TOVA, state, k, k, q, laid_out=state.slots)
    with pytest.raises(ValueError, match="at least one new token"):
        prepare(TOVA, state, k[:, :, :0], k[:, :, :0], q[:, :, :0])
    empty = TOVA.init(budget=8)
    one, q1 = mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 4, 1, 8))
    with pytest.raises(ValueError, match="dead slot"):
        prepare(TOVA, empty, one, one, q1, laid_out=state.slots)
