"""An undo log for exact trims: forget the last ``n`` fed tokens as if they never came.

Speculative decoding verifies ``num_draft + 1`` tokens in one call and then trims the rejected
ones; a prompt cache is trimmed back to a shared prefix. Eviction is not reversible by itself,
so every call records what it destroyed, relative to the slots it leaves behind:

- a token written over a slot: the previous dead-slot index, and the row it overwrote when that
  row was live (StreamingLLM drops its oldest first); a dead slot's row is the previous call's
  victim, which that call recorded when it evicted it (from its own candidates, so no copy of
  the slots being overwritten is kept alive and MLX can still write them in place);
- a chunk: how many live rows came before it, the dead slot it compacted away (with its row),
  and, when it evicted, the evicted candidates' rows and where every candidate went;
- the running fields (H2O's scores, MorphKV's probe rows, counters) as they were before (not
  the pinned spans: a trim keeps the spans pinned now, and a chunk fed again respects them); a
  history only as the rows the call pushed out of it (``HistoryBefore``,
  :mod:`velox_cache_core.history`: the rest is the history after the call), but in the newest
  entry;
- a token over lanes (heads with different row counts that evict at every step,
  :mod:`velox_cache_core.lanes`): each head's dead row before it, the lanes' running scores
  before it, and the rows it chose to evict (:class:`LaneStep`): undoing it puts the previous
  token's victims back where this one wrote, as for a dead slot.

Undoing a call rebuilds the previous slots exactly (same rows in the same slots, bit for bit);
a trim that ends inside a chunk undoes the chunk and feeds its first part again (the chunk's
inputs are kept for that). The log holds the last ``window`` tokens' worth of calls: at most
``2 * window`` rows per (batch row, KV head), reported as ``nbytes``. A call longer than
``window`` cannot be undone within that bound: it clears the log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import mlx.core as mx

from velox_cache_core import history
from velox_cache_core.declarations import PolicyState, arrays_in, running_fields
from velox_cache_core.history import History, HistoryBefore
from velox_cache_core.lanes import unwrite
from velox_cache_core.store import rows as store_rows
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.slots import TRANSIENT, KVSlots
from velox_cache_core.validation import check_int


@dataclass(frozen=True)
class LaneStep:
    """One token over lanes: ``free`` int32 ``[B, H]``, each head's dead row before it (flat
    indices into the ``N * W`` rows) and ``scores`` the lanes' running scores before it
    (``None``: they keep none); ``victim`` (keys/values ``[B, H, 1, D]``, positions
    ``[B, H, 1]``): the rows it chose as the next dead rows, which the next token overwrites
    (read back when that token is undone)."""

    free: mx.array
    scores: mx.array | None
    victim: KVSlots

    def arrays(self) -> list[mx.array]:
        return [self.free, *([] if self.scores is None else [self.scores]), *self.victim.arrays()]


@dataclass(frozen=True)
class Entry:
    """What one call of ``length`` tokens starting at ``start`` changed.

    running: every running field but ``slots`` before the call (``slots_none``: the state had
    no slots yet). Slots before the call, relative to the call's candidates:
    ``written`` int32 ``[B, H_kv]`` slot the single new token overwrote and ``row`` its previous
    content when it was live (a 1-slot store); ``victim`` the row a single token's call
    evicted; ``free`` the dead slot before the call; ``n_live`` the live rows a chunk (or an
    appended token) came after; ``order`` int32 ``[B, H_kv, n]`` the candidate index of every
    kept-then-evicted row and ``evicted`` those evicted rows, when the call reordered;
    ``inputs`` (keys, values, queries, scale) of a chunk, to feed a part of it again.
    ``keys_before``: keys quantized per channel before the call, as held (groups are formed
    and repacked as rows come and go, so the rows put back are not enough to hold them as
    they were; the arrays are shared with the store until it regroups).
    """

    start: int
    length: int
    running: dict[str, Any]
    slots_none: bool
    free: mx.array | None = None
    written: mx.array | None = None
    row: KVSlots | None = None
    victim: KVSlots | None = None
    n_live: int = 0
    order: mx.array | None = None
    evicted: KVSlots | None = None
    inputs: tuple[store_rows.Rows, store_rows.Rows, mx.array | None, float] | None = None
    lane_steps: tuple[LaneStep, ...] = ()
    keys_before: store_rows.Rows | None = None

    def arrays(self) -> list[mx.array]:
        """The arrays it records (not its running fields: those may be shared with other
        entries or with the state)."""
        out: list[mx.array] = [a for step in self.lane_steps for a in step.arrays()]
        out += [a for a in (self.free, self.written, self.order) if a is not None]
        out += [
            a for s in (self.row, self.victim, self.evicted) if s is not None for a in s.arrays()
        ]
        if isinstance(self.keys_before, KRows):  # its groups are the store's, or were
            out += [self.keys_before.window, self.keys_before.where]
        if self.inputs is not None:
            k, v, q, _ = self.inputs
            out += [*store_rows.arrays(k), *store_rows.arrays(v), *([] if q is None else [q])]
        return out


@dataclass(frozen=True)
class UndoLog:
    """The last calls' entries (oldest first), covering at least the last ``window`` tokens."""

    window: int
    entries: tuple[Entry, ...] = ()
    # how many of the last fed tokens a trim can take back: the entries' tokens (they never
    # change), counted once (a decode step asks every token); neither saved nor compared
    tokens: int = field(default=-1, compare=False, repr=False, metadata={TRANSIENT: True})

    def __post_init__(self) -> None:
        if self.tokens < 0:
            object.__setattr__(self, "tokens", sum(e.length for e in self.entries))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the log holds (reported apart from the kept rows): the rows and
        indices it records and the running fields it keeps, each array once (one the state
        still holds too is counted here as well: a bound)."""
        rows = sum(a.nbytes for e in self.entries for a in e.arrays())
        running = {id(a): a.nbytes for e in self.entries for a in arrays_in(e.running)}
        return rows + sum(running.values())

    def compacted(self) -> list[mx.array]:
        """The arrays :meth:`push` just copied out of the entry before the newest (histories'
        pushed-out rows): evaluate them with the call, so that the old rows can be freed."""
        if len(self.entries) < 2:
            return []
        kept = self.entries[-2].running.values()
        return [a for v in kept if isinstance(v, HistoryBefore) for a in v.arrays()]

    def arrays(self) -> list[mx.array]:
        return [a for e in self.entries for a in e.arrays()]

    def push(self, entry: Entry) -> UndoLog:
        if entry.length > self.window:
            return UndoLog(self.window)
        entries = (
            (*self.entries[:-1], _compacted(self.entries[-1], entry.running), entry)
            if self.entries
            else (entry,)
        )
        tokens = self.tokens + entry.length
        while tokens - entries[0].length >= self.window:
            tokens -= entries[0].length
            entries = entries[1:]
        return UndoLog(self.window, entries, tokens)

    def compact_newest(self, state: Any) -> UndoLog:
        """The log with its newest entry's histories kept compact against ``state``, the state
        right after that entry's call (:meth:`push` compacts the others): for a log that
        entries made elsewhere (the decode path's) are pushed onto, compacted already."""
        if not self.entries:
            return self
        newest = self.entries[-1]
        after = {k: getattr(state, k) for k in newest.running}
        return UndoLog(self.window, (*self.entries[:-1], _compacted(newest, after)), self.tokens)

    def cleared(self) -> UndoLog:
        return UndoLog(self.window)


def _compacted(entry: Entry, after: dict[str, Any]) -> Entry:
    """``entry`` keeping its histories as the rows its call pushed out
    (:func:`velox_cache_core.history.compact`); ``after``: the running fields after its call
    (the next entry's, when they are kept whole)."""
    running = entry.running
    if not any(v.__class__ is History for v in running.values()):
        return entry
    kept = {k: history.compact(v, after.get(k), entry.length) for k, v in running.items()}
    return replace(entry, running=kept)


def _running_before(entries: list[Entry], state: Any) -> dict[str, Any]:
    """The running fields as they were before the oldest of ``entries`` (consecutive calls,
    oldest first), from ``state``, the state right after the newest: each entry's compact
    histories rebuilt from the fields after its call, newest first."""
    running = {k: getattr(state, k) for k in entries[-1].running}
    for entry in reversed(entries):
        running = {k: history.before(v, running[k]) for k, v in entry.running.items()}
    return running


def new_log(window: int) -> UndoLog | None:
    """A log for ``window`` tokens (``None`` for 0: no trims)."""
    check_int("trim_window", window, minimum=0)
    return UndoLog(window) if window else None


def _permute(rows: KVSlots, order: mx.array) -> KVSlots:
    """Rows placed so that row ``i`` of ``rows`` lands at index ``order[..., i]``."""
    return rows.take(mx.argsort(order, axis=-1).astype(mx.int32))


def _concat(a: KVSlots, b: KVSlots) -> KVSlots:
    return KVSlots(
        store_rows.concat([a.keys, b.keys], axis=2),
        store_rows.concat([a.values, b.values], axis=2),
        mx.concatenate([a.positions, b.positions], axis=2),
    )


@cache
def running_names(state_type: Any) -> tuple[str, ...]:
    # the lanes are undone row by row (LaneStep), never kept whole: a copy of them per call
    # would hold the cache several times over; the pinned spans are not a call's doing (only
    # ``pin`` sets them), so undoing calls leaves them as they are
    skip = ("slots", "lanes", "pins")
    return tuple(name for name in running_fields(state_type) if name not in skip)


def _entry(state: PolicyState, start: int, length: int, inputs: Any, **recorded: Any) -> Entry:
    """The entry of a call of ``length`` tokens from ``start`` on ``state``: its running
    fields, its ``inputs`` when a chunk, and what it ``recorded``."""
    state_type: Any = type(state)
    return Entry(
        start=start,
        length=length,
        running={name: getattr(state, name) for name in running_names(state_type)},
        slots_none=state.slots is None,
        inputs=inputs if length > 1 else None,
        **recorded,
    )


def record(
    state: PolicyState,
    before: KVSlots,
    laid_out_from: KVSlots,
    candidates: KVSlots,
    kept: KVSlots,
    keys: store_rows.Rows,
    values: store_rows.Rows,
    queries: mx.array | None,
    scale: float,
) -> Entry:
    """The entry of one call: ``state`` and its slots ``before`` the call, the slots the
    candidates were laid out from (``before`` with a slot freed first, for StreamingLLM), the
    candidates and the ``kept`` slots."""
    L = int(keys.shape[2])
    written = row = victim = order = evicted = None
    n_live = 0
    if L == 1 and laid_out_from.free is not None:  # written over one slot
        written = laid_out_from.free
        if laid_out_from.free is not before.free:  # a live row, freed just now (StreamingLLM)
            row = before.take(written[..., None])
    else:
        n_live = before.n_kept
        if before.free is not None:
            row = before.take(before.free[..., None])
    if L == 1 and kept.keys is candidates.keys and kept.free is not None:
        victim = candidates.take(kept.free[..., None])
    if kept.keys is not candidates.keys:  # the rule took a subset in a new order
        n, m = candidates.n_slots, kept.n_slots
        same = kept.positions[..., :, None] == candidates.positions[..., None, :]
        survivors = mx.argmax(same, axis=-1).astype(mx.int32)  # [B, H, m]
        cols = mx.arange(n)
        gone = mx.argsort(mx.where(same.any(axis=2), n + cols, cols), axis=-1)[..., : n - m]
        gone = gone.astype(mx.int32)
        order = mx.concatenate([survivors, gone], axis=-1)
        evicted = candidates.take(gone)
    return _entry(
        state,
        state.offset,
        L,
        (keys, values, queries, scale),
        free=before.free,
        written=written,
        row=row,
        victim=victim,
        n_live=n_live,
        order=order,
        evicted=evicted,
        keys_before=before.keys if isinstance(before.keys, KRows) else None,
    )


def record_lanes(
    state: PolicyState, call_start: int, length: int, steps: list[LaneStep], inputs: Any
) -> Entry:
    """The entry of one call over lanes (``steps``: one per token, in order); the tail slots
    do not change on that path."""
    free = None if state.slots is None else state.slots.free
    return _entry(state, call_start, length, inputs, free=free, lane_steps=tuple(steps))


def _row_back(entry: Entry, previous: Entry | None) -> KVSlots | None:
    """The row that undoing ``entry`` (a token written over a slot) puts back in that slot:
    the live row it overwrote, else the previous call's victim (``previous``: the entry before
    it, if the log still has it). ``None``: the slot was dead and stays dead (its content is
    moot)."""
    return entry.row or (previous.victim if previous is not None else None)


def undo(state: Any, entry: Entry, previous: Entry | None) -> Any:
    """The state before the call ``entry`` recorded, from the state right after it
    (``previous``: the entry before it, whose victim the call may have overwritten)."""
    if entry.lane_steps:  # newest first, each token's dead rows back (holding the previous
        # token's victims, when the log still has it: else they stay dead), its scores back
        lanes = state.lanes
        steps = list(entry.lane_steps)
        prior = previous.lane_steps[-1] if previous is not None and previous.lane_steps else None
        for step, before in reversed(list(zip(steps, [prior, *steps[:-1]], strict=True))):
            victim = None if before is None else before.victim
            lanes = unwrite(lanes, step.free, victim, step.scores)
        return replace(state, lanes=lanes, **_running_before([entry], state))
    kept = state.slots
    assert kept is not None
    if entry.evicted is not None:
        assert entry.order is not None
        candidates = _permute(_concat(kept.compact(), entry.evicted), entry.order)
    else:
        candidates = replace(kept, free=None)
    if entry.written is not None:
        held = (candidates.keys, candidates.values, candidates.positions)
        row = _row_back(entry, previous)
        if row is not None:
            held = _put_row(held, entry.written, row)
        slots = KVSlots(*held, entry.free)
    else:
        slots = candidates.head(entry.n_live)
        if entry.free is not None:  # put the compacted-away dead slot back where it was
            assert entry.row is not None
            idx = mx.arange(entry.n_live, dtype=mx.int32)
            live_index = idx + (idx >= entry.free[..., None]).astype(mx.int32)
            order = mx.concatenate([live_index, entry.free[..., None]], axis=-1)
            slots = replace(_permute(_concat(slots, entry.row), order), free=entry.free)
    if entry.keys_before is not None:  # the same rows as they were held, bit for bit
        slots = KVSlots(entry.keys_before, slots.values, slots.positions, slots.free)
    return replace(
        state, slots=None if entry.slots_none else slots, **_running_before([entry], state)
    )


def _one_token_write(entry: Entry) -> bool:
    """Whether ``entry`` is a decode step that wrote its token over one slot (full-precision
    or quantized rows, no lanes, no reordering): :func:`undo` puts one row back for it."""
    return (
        entry.length == 1
        and entry.written is not None
        and not entry.lane_steps
        and entry.evicted is None
        and entry.keys_before is None
        and not entry.slots_none
    )


def _undo_steps(state: Any, entries: list[Entry], n: int) -> tuple[Any, int]:
    """Undo the newest of ``entries`` while they are decode steps that wrote over a slot (up
    to ``n`` tokens), popping them: the rows :func:`undo` would put back, newest first, with
    one new state at the end instead of one per token (a speculative round trims a few steps
    per layer). Returns the state and the tokens left to trim."""
    steps = 0
    while steps < n and steps < len(entries) and _one_token_write(entries[-1 - steps]):
        steps += 1
    if steps < 2:  # nothing to save: undo() it
        return state, n
    kept = state.slots
    assert kept is not None
    puts = []  # (slot [B, H_kv], row) newest first
    for i in range(len(entries) - 1, len(entries) - 1 - steps, -1):
        row, slot = _row_back(entries[i], entries[i - 1] if i else None), entries[i].written
        if row is not None:
            assert slot is not None
            puts.append((slot, row))
    held = _put_rows((kept.keys, kept.values, kept.positions), puts)
    undone = entries[-steps:]
    del entries[-steps:]
    # the running fields as they were before the oldest
    state = replace(state, slots=KVSlots(*held, undone[0].free), **_running_before(undone, state))
    return state, n - steps


Held = tuple[store_rows.Rows, store_rows.Rows, mx.array]  # a store's keys, values, positions


def _put_row(held: Held, slot: mx.array, row: KVSlots) -> Held:
    """A store's (keys, values, positions) with ``slot`` (int ``[B, H_kv]``) of each head set
    to ``row``, as :func:`undo` puts it back."""
    at = slot[..., None]
    keys, values, positions = held
    return (
        store_rows.put(keys, at, row.keys),
        store_rows.put(values, at, row.values),
        mx.put_along_axis(positions, at, row.positions, axis=2),
    )


def _put_rows(held: Held, puts: list[tuple[mx.array, KVSlots]]) -> Held:
    """``held`` with each ``(slot, row)`` of ``puts`` put back in turn (:func:`_put_row`): one
    compiled call for full-precision rows."""
    rows_in = [[row.keys, row.values, row.positions] for _, row in puts]
    if puts and all(a.__class__ is mx.array for r in (held, *rows_in) for a in r):
        return puts_kernel(len(puts))(*held, [slot for slot, _ in puts], rows_in)
    for slot, row in puts:
        held = _put_row(held, slot, row)
    return held


@cache
def puts_kernel(n: int) -> Callable[..., Any]:
    """``n`` rows put back in turn (:func:`_put_row`), compiled: full-precision rows only."""

    def kernel(
        keys: mx.array,
        values: mx.array,
        positions: mx.array,
        slots: list[mx.array],
        rows: list[list[mx.array]],
    ) -> Held:
        held: Held = (keys, values, positions)
        for slot, (k, v, p) in zip(slots, rows, strict=True):
            held = _put_row(held, slot, KVSlots(k, v, p))
        return held

    return mx.compile(kernel)


Feed = Callable[
    [Any, store_rows.Rows, store_rows.Rows, "mx.array | None", float, UndoLog], tuple[Any, UndoLog]
]


def trim(state: Any, log: UndoLog, n: int, feed: Feed) -> tuple[Any, UndoLog]:
    """Forget the last ``n`` tokens: ``(state, log)`` as if they had never been fed.

    ``feed(state, keys, values, queries, scale, log) -> (state, log)`` feeds the first part of a
    chunk again when the trim ends inside it. Raises ``ValueError`` (changing nothing) when the
    log holds fewer than ``n`` tokens.
    """
    check_int("n", n, minimum=0)
    if n > log.tokens:
        raise ValueError(
            f"cannot trim {n} tokens: the undo log holds the last {log.tokens} "
            f"(trim_window={log.window}; a longer call or a prompt-end step clears it)"
        )
    entries = list(log.entries)
    state, n = _undo_steps(state, entries, n)
    while n > 0:
        entry = entries.pop()
        state = undo(state, entry, entries[-1] if entries else None)
        keep = entry.length - min(n, entry.length)
        n -= entry.length - keep
        if keep:
            assert entry.inputs is not None
            k, v, q, scale = entry.inputs
            state, fed = feed(
                state,
                k[:, :, :keep],
                v[:, :, :keep],
                None if q is None else q[:, :, :keep],
                scale,
                UndoLog(log.window, tuple(entries)),
            )
            entries = list(fed.entries)
    return state, UndoLog(log.window, tuple(entries))
