"""What both decode-path stores hold beside their rows (:class:`Store`).

A decoding layer's store (:class:`~velox_cache_core.decode.evicting.Evicting`,
:class:`~velox_cache_core.decode.appending.Appending`) keeps its counters, the call in flight,
the undo entries of its steps (raw, since the layer entered the path) and the dict its offset
is mirrored into; :meth:`Store.leave` turns the entries back into the undo log when the layer
leaves the path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from velox_cache_core.engine import Step
from velox_cache_core.undo import Entry, UndoLog


class Store:
    """The fields both stores share. keys/values ``[B, H_kv, S, D]``: the rows the model
    attends over; ``token``: a decode token's (keys shape, values shape, keys dtype, values
    dtype); ``entries``: the raw undo entries since the layer entered the path (at most a
    window of them: once full, ``base_log``, the log the layer had then, is dropped, since
    pushing them would drop it); ``flight``/``chunk``/``decided``: the call in flight;
    ``shared``/``stepped``: what the last step (or each step of the last chunk) attended over,
    for a layer sharing this one's keys and values; ``mirror``: a dict whose ``"offset"`` the
    store keeps equal to the layer's offset while it decodes (the mlx-lm cache's, so that the
    model's reads of it cost no call), dropped when it leaves."""

    __slots__ = (
        "base_log",
        "chunk",
        "decided",
        "deferred",
        "entries",
        "flight",
        "heads",
        "here",
        "keys",
        "mirror",
        "offset",
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
        self.template = state
        self.keys, self.values = slots.keys, slots.values
        self.offset = int(state.offset)
        self.tokens_seen = int(state.tokens_seen)
        shape = slots.positions.shape
        self.heads = shape[0] * shape[1]
        self.token = (
            (shape[0], shape[1], 1, slots.keys.shape[3]),
            (shape[0], shape[1], 1, slots.values.shape[3]),
            slots.keys.dtype,
            slots.values.dtype,
        )
        # its newest entry compact now: the entries this path pushes on are compact already
        self.base_log = None if log is None else log.compact_newest(state)
        self.entries: deque[Any] | None = None if log is None else deque(maxlen=log.window)
        self.here = mx.default_device() == mx.cpu
        self.flight: Any = None
        self.chunk: tuple[Any, Any] | None = None
        self.decided: Any = None
        # a decode token whose write waits for its queries (Evicting.write's defer): the
        # write's inputs beside the token (the dead slot, whether evict_before's was read ahead)
        self.deferred: tuple[list[mx.array], bool] | None = None
        self.shared: tuple[Any, Any] | None = None
        self.stepped: list[tuple[int, int, Step]] = []
        self.steady = True
        self.mirror: dict[str, Any] | None = None

    def drop_as_pushed(self) -> None:
        """Drop the oldest entries of ``base_log`` that pushing the raw entries onto it would
        drop (:meth:`velox_cache_core.undo.UndoLog.push` keeps the newest entries covering
        ``window`` tokens): before a trim pops raw entries, so that the log left reaches back
        as far as the general path's would."""
        base, entries = self.base_log, self.entries
        if base is None or entries is None or not base.entries:
            return
        kept, tokens = base.entries, base.tokens + len(entries)
        while kept and tokens - kept[0].length >= base.window:
            tokens -= kept[0].length
            kept = kept[1:]
        if len(kept) != len(base.entries):
            self.base_log = UndoLog(base.window, kept)

    def leave(self, to_entry: Callable[[Any], Entry]) -> UndoLog | None:
        """Stop mirroring the offset; the undo log the general path would hold now: the
        entries (each made by ``to_entry`` from its raw form) pushed onto the log the layer
        had when it entered the path (``None``: it keeps none)."""
        if self.mirror is not None:
            self.mirror.pop("offset", None)
            self.mirror = None
        log, entries = self.base_log, self.entries
        if log is None and entries is not None:  # the entries cover the whole window
            log = UndoLog(entries.maxlen or 0)
        if log is not None and entries:
            for raw in entries:
                log = log.push(to_entry(raw))
        return log
