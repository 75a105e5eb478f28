"""How a :class:`velox_cache_core.layer.Layer` enters and leaves the decode path.

A layer takes the decode path (:mod:`velox_cache_core.decode`) at a decode token (or a short
chunk waiting for its queries) whose state the path takes (:func:`warm`), keeps its rows in the
path's store while the calls are decode steps, and leaves it (:func:`cool`) at the first call
the path does not take or the first read of its ``state``, ``log`` or ``pending``: the store
then becomes a frozen state, its raw undo entries the log's, and a token still in flight a
plain :class:`~velox_cache_core.in_flight.Waiting` call for the general path.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_cache_core import fast_step, in_flight
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.decode.appending import Appending
from velox_cache_core.decode.evicting import Evicting
from velox_cache_core.engine import Step
from velox_cache_core.in_flight import Decided, Mode, Waiting
from velox_cache_core.store import rows
from velox_cache_core.validation import check_scale


def lay_out_hot(layer: Any, keys: mx.array, values: mx.array) -> tuple[rows.Rows, rows.Rows] | None:
    """A decode token or a short chunk on the decode path; ``None`` (and the path left)
    when it does not take it."""
    hot = layer.hot
    assert hot is not None
    L = keys.shape[2]
    if L == 1:
        fetched = hot.write(keys, values)
    else:
        fetched = hot.lay_out_chunk(keys, values) if L <= in_flight.STEPPED_CHUNK else None
    if fetched is None:
        cool(layer)
        return None
    layer.fetched = fetched
    return fetched


def may_go_fast(layer: Any) -> bool:
    """Nothing is in flight and the layer's calls may take the decode path (:func:`_alone`)."""
    return layer._pending is None and _alone(layer)


def _alone(layer: Any) -> bool:
    """The decode path is on, and this layer decides alone (no group, no shared sums, no
    phase) over full-precision rows."""
    return (
        fast_step.ENABLED
        and layer.phase is None
        and layer.quant is None
        and layer.demote is None
        and layer.mode is not Mode.STEP_SUMS
        and layer.group is None
    )


def _takes(layer: Any, state: Any, length: int) -> fast_step.Kernels | bool | None:
    """Which store the decode path holds ``state`` in for its next call of ``length`` tokens:
    ``True`` for an appending one (SnapKV after its cut, its prompt ended), the kernels of an
    evicting one (:func:`velox_cache_core.fast_step.eligible`; a chunk only when it waits for
    its queries, mode ``QUERIES``), or ``None`` when the path does not take the call."""
    policy = layer.policy
    if state.slots is None:
        return None
    if length == 1 and fast_step.appends(policy, state):
        ended = policy.prompt_end is None or policy.end_prompt(state) is state
        return True if ended else None
    if policy.prompt_end is not None or (length > 1 and layer.mode is not Mode.QUERIES):
        return None
    return fast_step.eligible(policy, state, queries_needed=waits_fast(layer))


def warm(layer: Any, length: int) -> bool:
    """Take the decode path (:class:`~velox_cache_core.decode.Hot`) from the state now
    when its next call of ``length`` tokens is one the path takes (:func:`_takes`)."""
    state = layer._state
    taken = _takes(layer, state, length)
    if taken is None:
        return False
    if taken is True:
        layer.hot = Appending(state, layer._log)
    else:
        assert isinstance(taken, fast_step.Kernels)
        layer.hot = Evicting(layer.policy, state, layer._log, taken, layer.mode is Mode.AT_ONCE)
    return True


class Cooled:
    """A :class:`~velox_cache_core.layer.Layer` attribute (``state``, ``log``) held in the
    layer's ``_name``: read or set, it leaves the decode path first (:func:`cool`), so that
    what is read is the rows as the path left them."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        if layer is None:
            return self
        if layer.hot is not None:
            cool(layer)
        return layer.__dict__[self.slot]

    def __set__(self, layer: Any, value: Any) -> None:
        if layer.hot is not None:
            cool(layer)
        layer.__dict__[self.slot] = value


def cool(layer: Any) -> None:
    """Leave the decode path: the rows become a frozen state again, the undo entries the
    log's, and a token or chunk still waiting for its queries a plain :class:`Waiting`."""
    hot = layer.hot
    assert hot is not None
    layer.hot = None
    state, log, waiting, decided = hot.cool()
    layer._state, layer._log = state, log
    if waiting is not None:
        layer._pending = Waiting(*waiting)
    elif decided is not None:
        layer._pending = Decided(decided, 1)
    if hot.shared is not None:
        layer.last = Step(hot.shared[0], hot.shared[1], None, state)
    if hot.stepped:
        layer.stepped = hot.stepped


def fast_path(layer: Any) -> bool:
    """Whether this layer's next decode step (a token of the store's shape, nothing in
    flight) takes the decode path (:mod:`velox_cache_core.decode`)."""
    if layer.hot is not None:
        return bool(layer.hot.steady)
    return _alone(layer) and _takes(layer, layer.view(), 1) is not None


def waits_fast(layer: Any) -> bool:
    """Whether a decode-path step waits for its queries: a query-signal decision, or, on
    the CPU with the hook's queries to come, a decision without them whose compiled kernel
    attends too (attend once: one kernel instead of the kernel plus the attention's ops)."""
    if layer._waits(1):
        return True
    return layer.mode is Mode.QUERIES and mx.default_device() == mx.cpu


def attend_chunk(layer: Any, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
    """``[B, H_q, L, D]``: the short chunk in flight (only an evicting store lays one out)
    written, decided and attended one token at a time on the decode path; from a token whose
    step it does not take, the rest of the chunk goes through the general path (sequential
    prefill, the same meaning)."""
    hot = layer.hot
    assert isinstance(hot, Evicting) and hot.chunk is not None
    keys, values = hot.chunk
    outs, taken = hot.attend_chunk(queries, scale, sinks)
    L = int(keys.shape[2])
    if taken == L:
        return mx.concatenate(outs, axis=2)
    cool(layer)
    stepped = layer.stepped
    needs = layer._waits(1)
    rest = slice(taken, L)
    step = layer._feed(
        layer.state,
        keys=keys[:, :, rest],
        values=values[:, :, rest],
        queries=queries[:, :, rest] if needs else None,
        scale=check_scale(scale, int(keys.shape[3])) if needs else None,
    )
    layer.state = step.state
    layer.stepped = [*stepped, (taken, L, step)]
    outs.append(attend_step(queries[:, :, rest], step, scale, sinks))
    return mx.concatenate(outs, axis=2)
