"""A store that grows one token at a time writes into reserved rows instead of copying itself.

What must hold: the reserve never changes what a state holds (same rows as a store without one,
bit for bit), never outgrows a bounded policy's ``budget + 1`` slots, is counted in ``nbytes``,
survives an exact trim, and never lets one state's append show through in another state that
shares its buffers (a prompt cache and the request continuing from it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import POLICIES
from velox_cache_core.engine import GROW, update
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import new_log

B, H_KV, H_Q, D = 2, 2, 4, 8


def _tokens(n: int, seed: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k, v = (mx.array(rng.standard_normal((B, H_KV, 1, D)), dtype=mx.float32) for _ in "kv")
        out.append((k, v, mx.array(rng.standard_normal((B, H_Q, 1, D)), dtype=mx.float32)))
    return out


def _decode(name: str, state: Any, tokens: list[Any], log: Any = None) -> list[Any]:
    steps = []
    for k, v, q in tokens:
        step = update(POLICIES[name], state, k, v, q, log=log)
        state, log = step.state, step.log
        steps.append(step)
    return steps


def _rows(state: Any) -> list[np.ndarray]:
    return [np.array(a) for a in (state.keys, state.values, state.positions)]


def _without_reserve(slots: KVSlots) -> KVSlots:
    return KVSlots(slots.keys, slots.values, slots.positions, slots.free)


@pytest.mark.parametrize("name", ["tova", "h2o", "snapkv", "streaming_llm"])
def test_growing_decode_writes_in_place_and_holds_what_a_copy_holds(name: str) -> None:
    policy = POLICIES[name]
    budget = 40
    state = policy.init(budget=budget)
    tokens = _tokens(budget + 6, seed=1)
    grown = _decode(name, state, tokens)
    held = [s.state.slots.n_held for s in grown]
    kept = [s.state.slots.n_slots for s in grown]
    # The first token allocates room; the next ones fill it without a copy.
    assert held[0] > kept[0] and held[1] == held[0]
    if name != "snapkv":  # bounded policies never reserve past their decode bound
        assert max(held) <= budget + 1
    # Feeding each step from a copy of the state without its reserve (the plain
    # concatenation) keeps exactly the same rows.
    state = policy.init(budget=budget)
    for (k, v, q), step in zip(tokens, grown, strict=True):
        if state.slots is not None:
            state = type(state)(**{**vars(state), "slots": _without_reserve(state.slots)})
        state = update(policy, state, k, v, q).state
        for a, b in zip(_rows(state), _rows(step.state), strict=True):
            np.testing.assert_array_equal(a, b)


def test_nbytes_counts_the_reserved_rows() -> None:
    policy = POLICIES["tova"]
    state = _decode("tova", policy.init(budget=100), _tokens(3, seed=2))[-1].state
    # The first token's copy set GROW rows aside; the next two went into them.
    assert state.slots.n_slots == 3 and state.slots.n_held == 1 + GROW
    assert state.nbytes == B * H_KV * (1 + GROW) * D * 2 * 4


def test_branches_from_one_state_do_not_see_each_other() -> None:
    """Two continuations of one state (a saved prompt cache and the request reusing it) append
    into the same reserved rows: each must keep its own token, and the shared state its rows."""
    policy = POLICIES["tova"]
    base = _decode("tova", policy.init(budget=100), _tokens(5, seed=3))[-1].state
    mx.eval(base.slots.arrays())
    before = _rows(base)
    (a,) = _decode("tova", base, _tokens(1, seed=4))
    (b,) = _decode("tova", base, _tokens(1, seed=5))
    mx.eval(a.state.slots.arrays(), b.state.slots.arrays())
    for x, y in zip(before, _rows(base), strict=True):
        np.testing.assert_array_equal(x, y)
    ka, kb = np.array(a.state.keys), np.array(b.state.keys)
    np.testing.assert_array_equal(ka[:, :, :5], before[0])
    np.testing.assert_array_equal(kb[:, :, :5], before[0])
    np.testing.assert_array_equal(ka[:, :, 5:], np.array(_tokens(1, seed=4)[0][0]))
    np.testing.assert_array_equal(kb[:, :, 5:], np.array(_tokens(1, seed=5)[0][0]))


def test_a_trim_keeps_the_reserve_and_the_rows() -> None:
    policy = POLICIES["tova"]
    tokens = _tokens(10, seed=6)
    steps = _decode("tova", policy.init(budget=100), tokens, log=new_log(8))
    state, log = steps[-1].state, steps[-1].log
    trimmed, _ = policy.trim(state, log, 4)
    assert trimmed.slots.n_slots == 6 and trimmed.slots.n_held == state.slots.n_held
    for a, b in zip(_rows(trimmed), _rows(steps[5].state), strict=True):
        np.testing.assert_array_equal(a, b)
    # Decoding on after the trim writes over the reserved rows the trim gave back.
    again = _decode("tova", trimmed, tokens[6:])
    for a, b in zip(_rows(again[-1].state), _rows(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_held_nbytes_counts_every_array_the_state_holds() -> None:
    """Reserved buffers, not the views over them, and the running scores beside them."""
    policy = POLICIES["h2o"]
    state = _decode("h2o", policy.init(budget=100, n_sink=1, recent=2), _tokens(5, seed=7))[-1]
    state = state.state
    room = state.slots.reserve
    assert room is not None and room.view is state.slots.keys
    buffers = room.keys.nbytes + room.values.nbytes + room.positions.nbytes
    assert state.held_nbytes == buffers + state.scores.nbytes
    assert state.nbytes == room.keys.nbytes + room.values.nbytes
