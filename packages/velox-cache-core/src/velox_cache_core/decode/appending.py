"""The decode path's store for a policy that only appends after its prompt (:class:`Appending`).

SnapKV after its cut keeps every decoded token: a step writes the token into the next reserved
row of its buffers, in place (``mx.slice_update``), and attends over the first rows. This is
what :meth:`velox_cache_core.store.slots.KVSlots.append` does into a store's reserve, with the
undo entry :func:`velox_cache_core.undo.record` makes for an appended token, built from the
buffers here instead of a new frozen store, state and entry per token.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.attention import compiled_row
from velox_cache_core.declarations import fresh
from velox_cache_core.engine import Step
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import Entry, UndoLog, running_names


class Appending:
    """One layer's rows between decode steps of an appending state: the buffers ``[B, H_kv,
    R, D]`` (positions ``[B, H_kv, R]``) whose first ``n`` rows are the store."""

    __slots__ = (
        "base_log",
        "buffers",
        "chunk",
        "decided",
        "entries",
        "flight",
        "heads",
        "here",
        "keys",
        "mirror",
        "n",
        "offset",
        "running",
        "shared",
        "steady",
        "stepped",
        "template",
        "token",
        "tokens_seen",
        "values",
    )

    def __init__(self, state: Any, log: UndoLog | None) -> None:
        slots = state.slots
        room = slots.reserve
        assert room is not None and slots.has_room(1)
        self.template = state
        self.buffers = (room.keys, room.values, room.positions)
        self.keys, self.values = slots.keys, slots.values
        self.n = slots.n_slots
        self.offset = int(state.offset)
        self.tokens_seen = int(state.tokens_seen)
        shape = slots.positions.shape
        self.heads = shape[0] * shape[1]
        # the running fields an appended token leaves as they were (undo keeps them per entry)
        names = running_names(_type_of(state))
        self.running = {name: getattr(state, name) for name in names}
        self.token = (
            (shape[0], shape[1], 1, slots.keys.shape[3]),
            (shape[0], shape[1], 1, slots.values.shape[3]),
            slots.keys.dtype,
            slots.values.dtype,
        )
        self.base_log = log
        self.entries: deque[tuple[int, int, int]] | None = (
            None if log is None else deque(maxlen=log.window)
        )
        self.flight = self.chunk = None
        self.shared: tuple[Any, Any] | None = None
        self.decided: tuple[Any, Any] | None = None
        self.stepped: list[tuple[int, int, Step]] = []
        self.steady = True
        self.mirror: dict[str, Any] | None = None
        self.here = mx.default_device() == mx.cpu

    @property
    def idle(self) -> bool:
        """No appended token whose attention may still come."""
        return self.decided is None

    in_flight = 0  # an appended token is decided as it is laid out

    def arrays(self) -> list[mx.array]:
        """The buffers, to evaluate them in place."""
        return list(self.buffers)

    def write(self, keys: Any, values: Any, decide: bool = True) -> tuple[Any, Any] | None:
        """Append the decode token ``keys``/``values`` ``[B, H_kv, 1, D]`` in place; the
        store with it out, or ``None`` when it is not a token of the store's shape and dtype
        or the reserve is full (nothing changed)."""
        token = self.token
        n = self.n
        buf_k, buf_v, buf_p = self.buffers
        if not (
            decide
            and self.decided is None
            and keys.__class__ is mx.array
            and values.__class__ is mx.array
            and keys.shape == token[0]
            and values.shape == token[1]
            and keys.dtype == token[2]
            and values.dtype == token[3]
            and n < buf_k.shape[2]
        ):
            return None
        at = mx.array([n])
        position = mx.broadcast_to(mx.array([self.offset], dtype=mx.int32), token[0][:3])
        buf_k = mx.slice_update(buf_k, keys, at, (2,))
        buf_v = mx.slice_update(buf_v, values, at, (2,))
        buf_p = mx.slice_update(buf_p, position, at, (2,))
        self.buffers = (buf_k, buf_v, buf_p)
        if self.entries is not None:
            self.entries.append((self.offset, self.tokens_seen, n))
            if len(self.entries) == self.entries.maxlen:
                self.base_log = None  # the log now holds only these (see cool)
        self.n = n = n + 1
        self.offset += 1
        self.tokens_seen += self.heads
        self.keys, self.values = buf_k[:, :, :n], buf_v[:, :, :n]
        self.decided = (self.keys, self.values)
        self.shared = None
        self.stepped = []
        mirror = self.mirror
        if mirror is not None:
            mirror["offset"] = self.offset
        return self.decided

    def lay_out_chunk(self, keys: Any, values: Any) -> None:
        """Chunks take the general path."""
        return None

    def attend_chunk(self, queries: Any, scale: Any, sinks: Any) -> tuple[list[mx.array], int]:
        raise AssertionError("an appending store lays out no chunk")

    def attend(self, queries: Any, scale: Any, sinks: mx.array | None) -> mx.array | None:
        """``[B, H_q, 1, D]``: the appended token's queries (or a layer sharing this one's
        keys and values) over the store; ``None`` when nothing was laid out."""
        decided = self.decided
        if decided is not None:
            self.decided = None
            self.shared = decided
        shared = self.shared
        if shared is None:
            return None
        keys, values = shared
        if sinks is None and self.here and keys.shape[2] > 1 and queries.shape[2] == 1:
            # attention's one-row CPU kernel, as attend_step picks it (fewer calls a step)
            return compiled_row(queries, keys, values, scale)(queries, keys, values)
        return attend_step(queries, Step(keys, values, None, None), scale, sinks)

    def cool(self) -> tuple[Any, UndoLog | None, tuple[Any, Any] | None, Step | None]:
        """(the frozen state, the undo log, ``None`` (no token waits for its queries), the
        step laid out whose attention has not come or ``None``)."""
        if self.mirror is not None:
            self.mirror.pop("offset", None)
            self.mirror = None
        buf_k, buf_v, buf_p = self.buffers
        slots = KVSlots.in_reserve(buf_k, buf_v, buf_p, self.n)
        state = fresh(self.template, slots=slots, offset=self.offset, tokens_seen=self.tokens_seen)
        log = self.base_log
        if log is None and self.entries is not None:  # the entries cover the whole window
            log = UndoLog(self.entries.maxlen or 0)
        if log is not None and self.entries:
            for offset, tokens_seen, n_live in self.entries:
                running = {**self.running, "offset": offset, "tokens_seen": tokens_seen}
                entry = Entry(
                    start=offset, length=1, running=running, slots_none=False, n_live=n_live
                )
                log = log.push(entry)
        decided = None
        if self.decided is not None:
            decided = Step(slots.keys, slots.values, None, state, log)
        return state, log, None, decided


def _type_of(state: Any) -> Any:
    return type(state)
