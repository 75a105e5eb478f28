"""The last probe rows a windowed rule keeps (:class:`History`), and the form an undo entry keeps
one in (:class:`HistoryBefore`).

A history changes by one operation only, :meth:`History.extend`: a call's ``L`` probe rows are
appended and the oldest dropped beyond ``keep``. So the history before a call is the rows the
call pushed out followed by the first rows of the history after it. An undo entry that kept the
whole history before each call would hold ``window`` copies of it (MorphKV's probe rows,
Expected Attention's query window: more than the cache's own rows); :func:`compact` keeps only
the rows pushed out, copied out of the old array so that it can be freed, and
:func:`before` puts the history back, bit for bit, from the one after the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass(frozen=True)
class History:
    """The last probe rows, for windowed rules. probes ``[B, H_p, h, D]``, positions ``[h]``."""

    probes: mx.array
    positions: mx.array

    def extend(self, probes: mx.array, positions: mx.array, keep: int) -> History | None:
        if keep == 0:
            return None
        return History(
            mx.concatenate([self.probes, probes], axis=2)[:, :, -keep:],
            mx.concatenate([self.positions, positions])[-keep:],
        )


@dataclass(frozen=True)
class HistoryBefore:
    """A history as it was before a call, relative to the one after it: ``dropped`` (the rows
    the call pushed out, ``[B, H_p, d, D]`` and ``[d]``, own arrays) followed by the first
    ``rows - d`` rows of the history after the call."""

    dropped: History
    rows: int

    def arrays(self) -> list[mx.array]:
        return [self.dropped.probes, self.dropped.positions]


def compact(before: Any, after: Any, length: int) -> Any:
    """What an undo entry keeps of a running field that was ``before`` a call of ``length``
    tokens and is ``after`` it: a :class:`HistoryBefore` when both are histories that share
    rows, else ``before`` as it is."""
    if before.__class__ is not History or after.__class__ is not History or before is after:
        return before
    n, m = int(before.probes.shape[2]), int(after.probes.shape[2])
    shared = min(n, max(0, m - length))  # the call appended ``length`` rows (or >= keep)
    if shared == 0:
        return before
    d = n - shared
    # copies (a slice would keep the whole old array alive)
    dropped = History(mx.array(before.probes[:, :, :d]), mx.array(before.positions[:d]))
    return HistoryBefore(dropped, n)


def before(kept: Any, after: Any) -> Any:
    """The running field before a call from what its entry ``kept`` and its value ``after``
    the call (``kept`` itself unless it is a :class:`HistoryBefore`)."""
    if kept.__class__ is not HistoryBefore:
        return kept
    shared = kept.rows - int(kept.dropped.probes.shape[2])
    head = kept.dropped
    return History(
        mx.concatenate([head.probes, after.probes[:, :, :shared]], axis=2),
        mx.concatenate([head.positions, after.positions[:shared]]),
    )
