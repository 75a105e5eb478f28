"""Several independent sequences in one batch: each row is a single-sequence state.

Rows of a batch differ in length, position and evictions, so a batch is a tuple of
single-sequence (``B = 1``) states, one per row, each with its own undo log. A batched call
feeds ``[B, H_kv, L, D]`` keys/values in which row ``b``'s real tokens are the span
``left_padding[b] : left_padding[b] + lengths[b]``; the rest is padding, which is never stored,
scored, attended to or counted. Row ``b`` of a batched call is exactly the single-sequence call
on its span (row equivalence), and its attention output is zero at padded queries.

Operations: :func:`stack` single-sequence states into a batch, :meth:`BatchState.row` takes
one out, :meth:`BatchState.keep` keeps a subset of rows, :meth:`BatchState.concat` appends
another batch's rows, :func:`update` feeds a padded call and :func:`attend` attends it.

Packed rows: calling the engine once per row costs a decode step ``B`` times the graph
building and ``B`` small kernels per op. Rows whose slots are laid out alike (a full budget
each, as every row of a bounded policy has once it evicts) can instead be held as one ``B``-row
state (:func:`pack`) and decode as one call with per-row positions (:func:`packed_update`);
:func:`unpack` gives each row back exactly the state and undo log it would have alone. Rows
that have not reached their budget yet hold different slot counts: they pack *padded* (each
row's slots after ``pads[b]`` padding slots, which a mask hides from attention) for as long as
no row can evict, which for such a policy means while the longest row's next step stays within
the budget (:meth:`Packed.can_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.declarations import PolicyState, running_fields
from velox_cache_core.engine import Step
from velox_cache_core.pins import MAX_SPANS
from velox_cache_core.policy import Policy
from velox_cache_core.store import rows as R
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import Entry, UndoLog
from velox_cache_core.validation import check_kv

Span = tuple[int, int]  # (first, length) of a row's real tokens in a call


def row_signature(state: PolicyState) -> dict[str, Any]:
    """What rows of one batch must share: policy state type, settings and, once a row holds
    tokens, its KV heads, head dim and dtype."""
    sig: dict[str, Any] = {"policy state": type(state).__name__, **state.settings}
    if state.slots is not None:
        _, H, _, D = state.slots.keys.shape
        quant = R.quant_of(state.slots.keys)
        sig.update({"H_kv": H, "D": D, "dtype": str(state.slots.keys.dtype), "quant": quant})
    return sig


def check_compatible(first: dict[str, Any], other: dict[str, Any], what: str) -> None:
    """Raise ``ValueError`` naming every field where two row signatures differ (a field only
    one of them has, like the dtype of a row not fed yet, is not a difference)."""
    diff = [
        f"{k}: {first[k]!r} != {other[k]!r}" for k in first if k in other and first[k] != other[k]
    ]
    if first["policy state"] != other["policy state"]:
        diff = [f"policy state: {first['policy state']} != {other['policy state']}"]
    if diff:
        raise ValueError(f"cannot batch {what}: they differ in " + "; ".join(diff))


def _check_single(state: Any, i: int) -> None:
    if not isinstance(state, PolicyState):
        raise TypeError(f"states[{i}] must be a PolicyState, got {type(state).__name__}")
    if state.slots is not None and state.slots.keys.shape[0] != 1:
        raise ValueError(
            f"states[{i}] holds {state.slots.keys.shape[0]} rows; a batch stacks "
            "single-sequence states (B = 1)"
        )


@dataclass(frozen=True)
class BatchState:
    """``B`` sequences of one policy. ``rows[b]``: row ``b``'s state (``B = 1``); ``logs[b]``:
    its undo log or ``None``."""

    rows: tuple[Any, ...]
    logs: tuple[UndoLog | None, ...]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def offsets(self) -> list[int]:
        """Tokens seen per row (the true position of each row's next token)."""
        return [int(s.offset) for s in self.rows]

    @property
    def tokens_kept(self) -> list[int]:
        """Retained tokens per row (per KV head); padding is never counted."""
        return [int(s.tokens_kept) for s in self.rows]

    @property
    def nbytes(self) -> int:
        """Bytes of every row's retained keys and values (no padding)."""
        return sum(int(s.nbytes) for s in self.rows)

    def row(self, index: int) -> tuple[Any, UndoLog | None]:
        """Row ``index``'s single-sequence state and undo log (``IndexError`` if absent)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -self.batch_size <= index < self.batch_size:
            raise IndexError(f"row {index} out of range for a batch of {self.batch_size}")
        return self.rows[index], self.logs[index]

    def keep(self, indices: Sequence[int]) -> BatchState:
        """The batch of rows ``indices``, in that order (``IndexError`` for a missing row)."""
        picked = [self.row(int(i)) for i in indices]
        return BatchState(tuple(s for s, _ in picked), tuple(lg for _, lg in picked))

    def concat(self, other: BatchState) -> BatchState:
        """This batch's rows followed by ``other``'s (``ValueError`` if they cannot share a
        batch: different policy, settings, heads, head dim or dtype)."""
        if not isinstance(other, BatchState):
            raise TypeError(f"other must be a BatchState, got {type(other).__name__}")
        return stack([*self.rows, *other.rows], [*self.logs, *other.logs])


def stack(states: Sequence[Any], logs: Sequence[UndoLog | None] | None = None) -> BatchState:
    """One batch from single-sequence states (each ``B = 1`` or empty) of one policy with the
    same settings; ``logs``: their undo logs (default none). Raises ``ValueError`` naming what
    differs; the inputs are never changed."""
    if not states:
        raise ValueError("states must hold at least one state")
    logs = [None] * len(states) if logs is None else list(logs)
    if len(logs) != len(states):
        raise ValueError(f"logs must have one entry per state ({len(states)}), got {len(logs)}")
    for i, state in enumerate(states):
        _check_single(state, i)
    first = row_signature(states[0])
    for i, state in enumerate(states[1:], 1):
        check_compatible(first, row_signature(state), f"states[0] and states[{i}]")
        first = {**row_signature(state), **first}
    return BatchState(tuple(states), tuple(logs))


def spans(
    batch_size: int,
    length: int,
    lengths: Sequence[int] | None = None,
    left_padding: Sequence[int] | None = None,
) -> list[Span]:
    """Each row's real tokens in a call of ``length`` tokens: ``(first, count)`` with
    ``first = left_padding[b]`` and ``count = lengths[b]`` (default: every token after the
    padding). Raises ``ValueError`` when a span does not fit the call."""
    pads = [0] * batch_size if left_padding is None else [int(p) for p in left_padding]
    if len(pads) != batch_size:
        raise ValueError(f"left_padding must have {batch_size} entries, got {len(pads)}")
    counts = [length - p for p in pads] if lengths is None else [int(n) for n in lengths]
    if len(counts) != batch_size:
        raise ValueError(f"lengths must have {batch_size} entries, got {len(counts)}")
    for b, (p, n) in enumerate(zip(pads, counts, strict=True)):
        if p < 0 or n < 0 or p + n > length:
            raise ValueError(
                f"row {b}: left_padding ({p}) and lengths ({n}) must be >= 0 with sum <= the "
                f"call's {length} tokens"
            )
    return list(zip(pads, counts, strict=True))


def scatter(
    parts: Sequence[mx.array | None], row_spans: Sequence[Span], like: mx.array
) -> mx.array:
    """Per-row outputs ``[1, H, n_b, D]`` (``None`` for a row without real tokens) placed at
    their spans of a zero ``[B, H, L, D]`` array shaped like ``like`` (``D``: the parts' own,
    which is the values' width)."""
    _B, H, L, D = like.shape
    D = next((int(p.shape[3]) for p in parts if p is not None), D)
    rows = []
    for part, (first, count) in zip(parts, row_spans, strict=True):
        if part is None or count == 0:
            rows.append(mx.zeros((1, H, L, D), dtype=like.dtype))
            continue
        pieces = [part.astype(like.dtype)]
        if first:
            pieces.insert(0, mx.zeros((1, H, first, D), dtype=like.dtype))
        if first + count < L:
            pieces.append(mx.zeros((1, H, L - first - count, D), dtype=like.dtype))
        rows.append(mx.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0])
    return mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]


@dataclass(frozen=True)
class BatchStep:
    """One batched call: ``steps[b]`` is row ``b``'s :class:`Step` (``None`` when the row had
    no real token in the call), ``spans[b]`` where its tokens were, ``state`` the batch after."""

    steps: tuple[Step | None, ...]
    spans: tuple[Span, ...]
    state: BatchState


def update(
    policy: Policy,
    batch: BatchState,
    keys: Any,
    values: Any,
    queries: Any = None,
    scale: Any = None,
    *,
    lengths: Sequence[int] | None = None,
    left_padding: Sequence[int] | None = None,
    check_finite: bool = True,
) -> BatchStep:
    """Feed a padded call to every row: keys/values ``[B, H_kv, L, D]``, queries
    ``[B, H_q, L, D]``; row ``b`` gets its span (see :func:`spans`) as one single-sequence
    :func:`velox_cache_core.engine.update`. States are immutable: a call that raises leaves
    ``batch`` as it was."""
    if not isinstance(batch, BatchState):
        raise TypeError(f"batch must be a BatchState, got {type(batch).__name__}")
    check_kv(keys, values, expect=None, dtype=None)
    B, _, L, _ = keys.shape
    if batch.batch_size != B:
        raise ValueError(f"keys B ({B}) differs from the batch's {batch.batch_size} rows")
    row_spans = spans(B, L, lengths, left_padding)
    calls = []
    for b, (first, count) in enumerate(row_spans):
        part = slice(first, first + count)
        q = None if queries is None else queries[b : b + 1, :, part]
        calls.append((keys[b : b + 1, :, part], values[b : b + 1, :, part], q))
    steps: list[Step | None] = []
    rows, logs = list(batch.rows), list(batch.logs)
    for b, ((k, v, q), (_, count)) in enumerate(zip(calls, row_spans, strict=True)):
        if count == 0:
            steps.append(None)
            continue
        step = policy.update(
            rows[b],
            keys=k,
            values=v,
            queries=q,
            scale=scale,
            check_finite=check_finite,
            log=logs[b],
        )
        steps.append(step)
        rows[b], logs[b] = step.state, step.log
    return BatchStep(tuple(steps), tuple(row_spans), BatchState(tuple(rows), tuple(logs)))


def attend(
    queries: mx.array, step: BatchStep, scale: float, sinks: mx.array | None = None
) -> mx.array:
    """``[B, H_q, L, D]``: each row's queries over its own step (its own keys, positions and
    mask: rows never see each other's padding); zero at padded queries."""
    parts: list[mx.array | None] = []
    for b, (row_step, (first, count)) in enumerate(zip(step.steps, step.spans, strict=True)):
        if row_step is None:
            parts.append(None)
            continue
        q = queries[b : b + 1, :, first : first + count]
        parts.append(attend_step(q, row_step, scale, sinks))
    return scatter(parts, step.spans, queries)


def end_prompt(
    policy: Policy, batch: BatchState, indices: Sequence[int] | None = None
) -> BatchState:
    """The batch after rows ``indices`` (default: all) end their prompts (SnapKV's cut; a
    no-op for policies without a prompt-end step)."""
    chosen = range(batch.batch_size) if indices is None else [int(i) for i in indices]
    rows, logs = list(batch.rows), list(batch.logs)
    for b in chosen:
        state, log = batch.row(b)
        ended = policy.end_prompt(state)
        if ended is not state and log is not None:  # the cut cannot be undone
            logs[b] = log.cleared()
        rows[b] = ended
    return BatchState(tuple(rows), tuple(logs))


# -- packed rows: a batch's decode steps as one engine call -------------------------------------
_COUNTERS = ("slots", "offset", "tokens_seen")


@dataclass(frozen=True)
class Packed:
    """Rows of a batch held as one ``B``-row state, so that a decode step is one engine call
    (``update(..., row_start=...)``) instead of ``B``: rows keep their own positions, slots
    and running arrays, stacked on the batch axis.

    state: the ``B``-row state (its ``offset``/``tokens_seen`` only count packed calls);
    log: the packed calls' undo log (``None`` without logs); offsets, seen: each row's
    ``offset`` and ``tokens_seen`` now; logs: each row's undo log from before packing;
    calls: packed calls so far; pads: padding slots before each row's slots (all 0 when the
    rows were laid out alike), hidden from attention by :attr:`mask`.
    """

    state: Any
    log: UndoLog | None
    offsets: tuple[int, ...]
    seen: tuple[int, ...]
    logs: tuple[UndoLog | None, ...]
    calls: int = 0
    pads: tuple[int, ...] = ()
    budget: int | None = None

    @property
    def padded(self) -> bool:
        return any(self.pads)

    @property
    def tokens_kept(self) -> list[int]:
        """Each row's retained tokens (per KV head), padding not counted."""
        n = int(self.state.n_kept)
        return [n - pad for pad in self.pads] if self.pads else [n] * len(self.offsets)

    def can_step(self) -> bool:
        """Whether the next decode step can run packed: always for rows laid out alike; for
        padded rows, while the longest row's candidates stay within the budget (nothing is
        evicted, so the padding is never scored or chosen)."""
        if not self.padded:
            return True
        return self.budget is not None and self.state.slots.n_slots + 1 <= self.budget

    def mask(self, n: int) -> mx.array:
        """bool ``[B, 1, 1, n]``: which of ``n`` candidate slots hold a row's tokens."""
        pads = mx.array(self.pads, dtype=mx.int32)
        return (mx.arange(n, dtype=mx.int32)[None] >= pads[:, None])[:, None, None]


def _slice_rows(value: Any, b: int) -> Any:
    """Row ``b`` of a packed field (arrays, slot stores; ``None`` stays ``None``)."""
    if isinstance(value, mx.array):
        return value[b : b + 1]
    if isinstance(value, KVSlots):
        free = None if value.free is None else value.free[b : b + 1]
        return KVSlots(
            value.keys[b : b + 1], value.values[b : b + 1], value.positions[b : b + 1], free
        )
    return value


def can_pack(policy: Policy, states: Sequence[Any]) -> bool:
    """Whether single-sequence ``states`` of ``policy`` can decode packed: the policy
    ``packs_rows`` and either every state holds slots laid out alike (same slot count, dead
    slot in all or none) and every other running field is an array in all of them or ``None``
    in all, or (padded, see the module doc) no state has a dead slot or any running array
    and the longest row's next decode step stays within the budget."""
    if not policy.packs_rows or len(states) < 2 or not _single_rows(states):
        return False
    if _laid_out_alike(states):
        return _running_arrays_alike(states)
    return _can_pad(policy, states)


def _single_rows(states: Sequence[Any]) -> bool:
    return all(s.slots is not None and s.slots.keys.shape[0] == 1 for s in states)


def _laid_out_alike(states: Sequence[Any]) -> bool:
    first = states[0].slots
    n, dead = first.n_slots, first.free is None
    return all(s.slots.n_slots == n and (s.slots.free is None) == dead for s in states)


def _others(state: Any) -> list[str]:
    """The running fields besides the slots and counters."""
    return [name for name in running_fields(state) if name not in _COUNTERS]


def _running_arrays_alike(states: Sequence[Any]) -> bool:
    for name in _others(states[0]):
        if name == "pins":  # rows without pins pack with empty spans
            continue
        values = [getattr(s, name) for s in states]
        if not (all(v is None for v in values) or all(isinstance(v, mx.array) for v in values)):
            return False
    return True


def _can_pad(policy: Policy, states: Sequence[Any]) -> bool:
    budget = policy.traits.budget(states[0])
    longest = max(s.slots.n_slots for s in states)
    return (
        budget is not None
        and longest + 1 <= budget
        and all(s.slots.free is None for s in states)
        and all(
            getattr(s, name) is None
            for s in states
            for name in _others(states[0])
            if name != "pins"
        )
    )


def _padded(slots: KVSlots, pad: int) -> KVSlots:
    """``slots`` after ``pad`` padding slots (zero rows at position -1)."""
    if pad == 0:
        return slots
    B, H = slots.positions.shape[:2]
    return KVSlots(
        R.pad(slots.keys, pad, at_end=False),
        R.pad(slots.values, pad, at_end=False),
        mx.concatenate([mx.full((B, H, pad), -1, dtype=mx.int32), slots.positions], axis=2),
    )


def pack(policy: Policy, states: Sequence[Any], logs: Sequence[UndoLog | None]) -> Packed:
    """Pack single-sequence states of ``policy`` (see :func:`can_pack`) and their undo logs;
    rows with fewer slots than the longest are padded before their slots."""
    first = states[0]
    longest = max(s.slots.n_slots for s in states)
    pads = tuple(longest - s.slots.n_slots for s in states)
    changes: dict[str, Any] = {"slots": _stack_slots(states, pads), "offset": 0, "tokens_seen": 0}
    for name in _others(first):
        if name == "pins":
            changes[name] = _stacked_pins(states)
        elif getattr(first, name) is not None:
            changes[name] = mx.concatenate([getattr(s, name) for s in states], axis=0)
    window = next((lg.window for lg in logs if lg is not None), 0)
    return Packed(
        state=replace(first, **changes),
        log=UndoLog(window) if window else None,
        offsets=tuple(int(s.offset) for s in states),
        seen=tuple(int(s.tokens_seen) for s in states),
        logs=tuple(logs),
        pads=pads,
        budget=policy.traits.budget(first),
    )


def _stacked_pins(states: Sequence[Any]) -> mx.array | None:
    """Every row's pinned spans on the batch axis (a row without pins: empty spans), or
    ``None`` when no row has any."""
    if all(s.pins is None for s in states):
        return None
    empty = mx.zeros((1, MAX_SPANS, 2), dtype=mx.int32)
    return mx.concatenate([empty if s.pins is None else s.pins for s in states], axis=0)


def _stack_slots(states: Sequence[Any], pads: tuple[int, ...]) -> KVSlots:
    """Every row's slots after its padding, stacked on the batch axis."""
    slots = [_padded(s.slots, pad) for s, pad in zip(states, pads, strict=True)]
    frees = [s.free for s in slots if s.free is not None]  # in every row or in none
    return KVSlots(
        R.concat([s.keys for s in slots], axis=0),
        R.concat([s.values for s in slots], axis=0),
        mx.concatenate([s.positions for s in slots], axis=0),
        mx.concatenate(frees, axis=0) if frees else None,
    )


def packed_update(
    policy: Policy,
    packed: Packed,
    keys: R.Rows,
    values: R.Rows,
    queries: mx.array | None,
    scale: float | None,
) -> tuple[Step, Packed]:
    """One decode step (keys/values ``[B, H_kv, 1, D]``, queries ``[B, H_q, 1, D]``) of every
    packed row at its own position: the step to attend over (masking padded rows' padding)
    and the packed rows after it. Padded rows must be able to step (:meth:`Packed.can_step`;
    ``ValueError`` otherwise: unpack them first)."""
    if not packed.can_step():
        raise ValueError(
            "padded packed rows would reach their budget in this step: unpack them first"
        )
    step = policy.update(
        packed.state,
        keys=keys,
        values=values,
        queries=queries,
        scale=scale,
        check_finite=False,
        log=packed.log,
        row_start=packed.offsets,
    )
    if packed.padded:  # attention over the candidates, minus each row's padding
        step = replace(step, mask=packed.mask(int(step.keys.shape[2])), probs=None)
    H = int(keys.shape[1])
    return step, replace(
        packed,
        state=step.state,
        log=step.log,
        offsets=tuple(o + 1 for o in packed.offsets),
        seen=tuple(s + H for s in packed.seen),
        calls=packed.calls + 1,
    )


def _row_entry(entry: Entry, b: int, offset: int, seen: int, pad: int) -> Entry:
    """Row ``b``'s part of a packed call's undo entry; the row was at ``offset`` having seen
    ``seen`` before the call, after ``pad`` padding slots."""
    running = {k: _slice_rows(v, b) for k, v in entry.running.items()}
    running.update(offset=offset, tokens_seen=seen)
    return replace(
        entry,
        start=offset,
        running=running,
        n_live=entry.n_live - pad,
        free=_slice_rows(entry.free, b),
        written=_slice_rows(entry.written, b),
        row=_slice_rows(entry.row, b),
        victim=_slice_rows(entry.victim, b),
        order=_slice_rows(entry.order, b),
        evicted=_slice_rows(entry.evicted, b),
    )


def detach(state: Any) -> Any:
    """``state`` with its slots and running arrays in buffers of their own. An unpacked row's
    arrays are views of the packed buffers and keep them alive whole (``B`` rows' worth for
    one) for as long as the row is held, as a prompt cache holds a finished sequence."""
    slots = state.slots
    if slots is None:
        return state
    free = None if slots.free is None else mx.contiguous(slots.free)
    changes: dict[str, Any] = {
        "slots": KVSlots(
            R.apply(slots.keys, mx.contiguous),
            R.apply(slots.values, mx.contiguous),
            mx.contiguous(slots.positions),
            free,
        )
    }
    for name in running_fields(state):
        value = getattr(state, name)
        if name not in _COUNTERS and isinstance(value, mx.array):
            changes[name] = mx.contiguous(value)
    return replace(state, **changes)


def unpack(packed: Packed) -> tuple[list[Any], list[UndoLog | None]]:
    """Each row's single-sequence state and undo log, as if it had decoded alone (its slots
    are views of the packed arrays, padding left out, until :func:`detach` copies them; its log
    holds its part of the packed calls' entries)."""
    state = packed.state
    H = int(state.slots.keys.shape[1])
    states, logs = [], []
    held = () if packed.log is None else packed.log.entries
    dropped = packed.calls - len(held)  # packed calls the packed log no longer holds
    pads = packed.pads or (0,) * len(packed.offsets)
    for b, (offset, seen) in enumerate(zip(packed.offsets, packed.seen, strict=True)):
        changes = {
            name: _slice_rows(getattr(state, name), b)
            for name in running_fields(state)
            if name not in ("offset", "tokens_seen")
        }
        if pads[b]:  # a padded row holds no dead slot (see can_pack)
            slots = changes["slots"]
            changes["slots"] = KVSlots(
                slots.keys[:, :, pads[b] :],
                slots.values[:, :, pads[b] :],
                slots.positions[:, :, pads[b] :],
            )
        states.append(replace(state, offset=offset, tokens_seen=seen, **changes))
        log = packed.logs[b]
        if log is not None:
            # Calls the packed log dropped leave a gap the row's older entries cannot bridge.
            log = log.cleared() if dropped else log
            for i, entry in enumerate(held):
                back = len(held) - i  # calls from this entry's to now
                log = log.push(_row_entry(entry, b, offset - back, seen - back * H, pads[b]))
        logs.append(log)
    return states, logs
