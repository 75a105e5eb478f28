"""The decode path's store for a policy that only appends after its prompt (:class:`Appending`).

SnapKV after its cut keeps every decoded token: a step writes the token into the next reserved
row of its buffers, in place (``mx.slice_update``), and attends over the first rows. This is
what :meth:`velox_cache_core.store.slots.KVSlots.append` does into a store's reserve, with the
undo entry :func:`velox_cache_core.undo.record` makes for an appended token, built from the
buffers here instead of a new frozen store, state and entry per token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.attention import compiled_row
from velox_cache_core.decode.store import Store
from velox_cache_core.engine import Step
from velox_cache_core.fast_step import state_type
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import Entry, UndoLog, running_names


class Appending(Store):
    """One layer's rows between decode steps of an appending state: the buffers ``[B, H_kv,
    R, D]`` (positions ``[B, H_kv, R]``) whose first ``n`` rows are the store."""

    __slots__ = ("buffers", "n", "running")

    def __init__(self, state: Any, log: UndoLog | None) -> None:
        super().__init__(state, log)
        slots = state.slots
        room = slots.reserve
        assert room is not None and slots.has_room(1)
        self.buffers = (room.keys, room.values, room.positions)
        self.n = slots.n_slots
        # the running fields an appended token leaves as they were (undo keeps them per entry)
        self.running = {name: getattr(state, name) for name in running_names(state_type(state))}

    @property
    def idle(self) -> bool:
        """No appended token whose attention may still come."""
        return self.decided is None

    in_flight = 0  # an appended token is decided as it is laid out

    def arrays(self) -> list[mx.array]:
        """The buffers, to evaluate them in place."""
        return list(self.buffers)

    def write(
        self, keys: Any, values: Any, decide: bool = True, defer: bool = False
    ) -> tuple[Any, Any] | None:
        """Append the decode token ``keys``/``values`` ``[B, H_kv, 1, D]`` in place; the
        store with it out, or ``None`` when it is not a token of the store's shape and dtype
        or the reserve is full (nothing changed). ``defer`` changes nothing here (nothing is
        decided)."""
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

    def trim(self, n: int) -> bool:
        """Take back the last ``n`` appended tokens in place (the rows after them become
        reserved rows again, as :func:`velox_cache_core.undo.undo` leaves them); ``False``
        (nothing changed) when the store cannot: a token whose attention has not come, no undo
        log, or fewer raw entries here than ``n``."""
        entries = self.entries
        if n == 0:
            return True
        if entries is None or n > len(entries) or self.decided is not None:
            return False
        self.drop_as_pushed()
        for _ in range(n - 1):
            entries.pop()
        self.offset, self.tokens_seen, n_live = entries.pop()
        self.n = n_live
        buf_k, buf_v, _ = self.buffers
        self.keys, self.values = buf_k[:, :, :n_live], buf_v[:, :, :n_live]
        self.shared = None
        self.stepped = []
        if self.mirror is not None:
            self.mirror["offset"] = self.offset
        return True

    def lay_out_chunk(self, keys: Any, values: Any) -> None:
        """Chunks take the general path."""
        return None

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
        log = self.leave(self._entry)
        buf_k, buf_v, buf_p = self.buffers
        slots = KVSlots.in_reserve(buf_k, buf_v, buf_p, self.n)
        state = replace(
            self.template, slots=slots, offset=self.offset, tokens_seen=self.tokens_seen
        )
        decided = None
        if self.decided is not None:
            decided = Step(slots.keys, slots.values, None, state, log)
        return state, log, None, decided

    def _entry(self, raw: tuple[int, int, int]) -> Entry:
        """The undo entry the general path makes for an appended token: (offset, tokens seen,
        the rows it came after)."""
        offset, tokens_seen, n_live = raw
        running = {**self.running, "offset": offset, "tokens_seen": tokens_seen}
        return Entry(start=offset, length=1, running=running, slots_none=False, n_live=n_live)
