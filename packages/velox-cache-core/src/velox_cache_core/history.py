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
    dropped = pushed_out(before, int(after.probes.shape[2]), length)
    return before if dropped is None else HistoryBefore(dropped, int(before.probes.shape[2]))


def pushed_out(before: History, after_rows: int, length: int) -> History | None:
    """The rows a call of ``length`` tokens pushed out of ``before``, when the history after it
    holds ``after_rows`` rows: copies (a slice would keep the whole old array alive), or
    ``None`` when the two share no row (an undo entry then keeps ``before`` whole). Plain
    array ops, so a compiled decode step makes them too
    (:func:`velox_cache_core.fast_step.decide_kernel`)."""
    n = int(before.probes.shape[2])
    shared = min(n, max(0, after_rows - length))  # the call appended ``length`` rows (or >= keep)
    if shared == 0:
        return None
    d = n - shared
    return History(mx.array(before.probes[:, :, :d]), mx.array(before.positions[:d]))


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
