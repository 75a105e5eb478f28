"""The decode path's raw undo entries (:data:`Raw`, one per step of an evicting store): the
compact form an entry takes once a newer one follows, and the general path's
:class:`~velox_cache_core.undo.Entry` an entry becomes when the layer leaves the path."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_cache_core import fast_step
from velox_cache_core.history import History, HistoryBefore
from velox_cache_core.undo import Entry

# A raw undo entry: (offset, tokens_seen, running fields before, dead slot before, slot
# written, the row it overwrote as arrays or None, the victim's rows as arrays, the rows the
# step pushed out of each history, copied by the kernel: the entry's compact histories)
Raw = tuple[int, int, list[list[Any]], Any, mx.array, Any, list[mx.array], list[list[mx.array]]]


def compact(kernels: fast_step.Kernels, raw: Raw) -> Raw:
    """``raw`` keeping its histories as the rows its step pushed out, which its kernel copied
    (what :func:`velox_cache_core.history.compact` keeps), once a newer entry follows it."""
    running, pushed = list(raw[2]), raw[7]
    for i, rows in zip(kernels.histories, pushed, strict=True):
        if rows and running[i]:
            n = int(running[i][0][0].shape[2])
            running[i] = [HistoryBefore(History(rows[0], rows[1]), n)]
    return (*raw[:2], running, *raw[3:7], [])


def entry(kernels: fast_step.Kernels, raw: Raw) -> Entry:
    """The undo entry the general path's ``undo.record`` makes for a decode step."""
    offset, tokens_seen, running, free, written, row, victim, _ = raw
    before = dict(zip(kernels.running, fast_step.unflat_running(kernels, running), strict=True))
    before["offset"], before["tokens_seen"] = offset, tokens_seen
    return Entry(
        start=offset,
        length=1,
        running={name: before[name] for name in kernels.undo_names},
        slots_none=False,
        free=free,
        written=written,
        row=None if row is None else fast_step.slots_of(*row),
        victim=fast_step.slots_of(*victim) if victim else None,
    )
