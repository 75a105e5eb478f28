"""Packed rows: a batch's decode steps as one engine call (the batch itself:
:mod:`velox_cache_core.batch`).

Calling the engine once per row costs a decode step ``B`` times the graph building and ``B``
small kernels per op. Rows whose slots are laid out alike (a full budget each, as every row of
a bounded policy has once it evicts) can instead be held as one ``B``-row state (:func:`pack`)
and decode as one call with per-row positions (:func:`packed_update`); :func:`unpack` gives
each row back exactly the state and undo log it would have alone. Rows that have not reached
their budget yet hold different slot counts: they pack *padded* (each row's slots after
``pads[b]`` padding slots, which a mask hides from attention) for as long as no row can evict,
which for such a policy means while the longest row's next step stays within the budget
(:meth:`Packed.can_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.declarations import running_fields
from velox_cache_core.engine import Step
from velox_cache_core.pins import MAX_SPANS
from velox_cache_core.policy import Policy
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import Entry, UndoLog

_COUNTERS = ("slots", "offset", "tokens_seen")


@dataclass(frozen=True)
class Packed:
    """Rows of a batch held as one ``B``-row state, so that a decode step is one engine call
    (``update(..., row_start=...)``) instead of ``B``: rows keep their own positions, slots
    and running arrays, stacked on the batch axis.

    state: the ``B``-row state (its ``offset``/``tokens_seen`` only count packed calls);
    log: the packed calls' undo log (``None`` without logs); offsets, seen: each row's
    ``offset`` and ``tokens_seen`` now; logs: each row's undo log from before packing;
    pads: padding slots before each row's slots (all 0 when the rows were laid out alike),
    hidden from attention by :attr:`mask`; budget: the policy's; calls: packed calls so far.
    """

    state: Any
    log: UndoLog | None
    offsets: tuple[int, ...]
    seen: tuple[int, ...]
    logs: tuple[UndoLog | None, ...]
    pads: tuple[int, ...]
    budget: int | None
    calls: int = 0

    @property
    def padded(self) -> bool:
        return any(self.pads)

    @property
    def tokens_kept(self) -> list[int]:
        """Each row's retained tokens (per KV head), padding not counted."""
        return [int(self.state.n_kept) - pad for pad in self.pads]

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


def _slice_rows(value: Any, b: int, pad: int = 0) -> Any:
    """Row ``b`` of a packed field: of arrays, and of slot stores less their first ``pad``
    (padding) slots; anything else (``None``) as it is."""
    if isinstance(value, mx.array):
        return value[b : b + 1]
    if isinstance(value, KVSlots):
        at = (slice(b, b + 1), slice(None), slice(pad, None))
        free = None if value.free is None else value.free[b : b + 1]
        return KVSlots(value.keys[at], value.values[at], value.positions[at], free)
    return value


def can_pack(policy: Policy, states: Sequence[Any]) -> bool:
    """Whether single-sequence ``states`` of ``policy`` can decode packed: the policy
    ``packs_rows`` and either every state holds slots laid out alike (same slot count, dead
    slot in all or none) and every other running field is an array in all of them or ``None``
    in all, or (padded, see the module doc) no state has a dead slot or any running array
    and the longest row's next decode step stays within the budget."""
    if not policy.packs_rows or len(states) < 2:
        return False
    if not all(s.slots is not None and s.slots.keys.shape[0] == 1 for s in states):
        return False
    slots = [s.slots for s in states]
    others = [[getattr(s, name) for s in states] for name in _others(states[0])]
    n, dead = slots[0].n_slots, slots[0].free is None
    if all(s.n_slots == n and (s.free is None) == dead for s in slots):  # laid out alike
        return all(_alike(values) for values in others)
    return _can_pad(policy.traits.budget(states[0]), slots, others)


def _alike(values: list[Any]) -> bool:
    """Whether a running field is ``None`` in every row or an array in every row."""
    return all(v is None for v in values) or all(isinstance(v, mx.array) for v in values)


def _can_pad(budget: int | None, slots: list[KVSlots], others: list[list[Any]]) -> bool:
    """Whether rows laid out differently can pack padded: no dead slot, no other running
    array, and the longest row's next decode step within the ``budget``."""
    return (
        budget is not None
        and max(s.n_slots for s in slots) + 1 <= budget
        and all(s.free is None for s in slots)
        and all(v is None for values in others for v in values)
    )


def _others(state: Any) -> list[str]:
    """The running fields besides the slots, counters and pinned spans (rows without pins pack
    with empty spans)."""
    return [name for name in running_fields(state) if name not in (*_COUNTERS, "pins")]


def _padded(slots: KVSlots, pad: int) -> KVSlots:
    """``slots`` after ``pad`` padding slots (zero rows at position -1)."""
    if pad == 0:
        return slots
    B, H = slots.positions.shape[:2]
    return KVSlots(
        rows.pad(slots.keys, pad, at_end=False),
        rows.pad(slots.values, pad, at_end=False),
        mx.concatenate([mx.full((B, H, pad), -1, dtype=mx.int32), slots.positions], axis=2),
    )


def pack(policy: Policy, states: Sequence[Any], logs: Sequence[UndoLog | None]) -> Packed:
    """Pack single-sequence states of ``policy`` (see :func:`can_pack`) and their undo logs;
    rows with fewer slots than the longest are padded before their slots."""
    first = states[0]
    longest = max(s.slots.n_slots for s in states)
    pads = tuple(longest - s.slots.n_slots for s in states)
    changes: dict[str, Any] = {
        "slots": _stack_slots(states, pads),
        "offset": 0,
        "tokens_seen": 0,
        "pins": _stacked_pins(states),
    }
    for name in _others(first):
        if getattr(first, name) is not None:
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
        rows.concat([s.keys for s in slots], axis=0),
        rows.concat([s.values for s in slots], axis=0),
        mx.concatenate([s.positions for s in slots], axis=0),
        mx.concatenate(frees, axis=0) if frees else None,
    )


def packed_update(
    policy: Policy,
    packed: Packed,
    keys: rows.Rows,
    values: rows.Rows,
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
    fields = ("free", "written", "row", "victim", "order", "evicted")
    sliced = {name: _slice_rows(getattr(entry, name), b) for name in fields}
    return replace(entry, start=offset, running=running, n_live=entry.n_live - pad, **sliced)


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
            rows.apply(slots.keys, mx.contiguous),
            rows.apply(slots.values, mx.contiguous),
            mx.contiguous(slots.positions),
            free,
        )
    }
    for name in running_fields(state):
        if name not in _COUNTERS and isinstance(value := getattr(state, name), mx.array):
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
    for b, (offset, seen, pad) in enumerate(
        zip(packed.offsets, packed.seen, packed.pads, strict=True)
    ):
        changes = {  # a padded row holds no dead slot and no other running array (can_pack)
            name: _slice_rows(getattr(state, name), b, pad)
            for name in running_fields(state)
            if name not in ("offset", "tokens_seen")
        }
        states.append(replace(state, offset=offset, tokens_seen=seen, **changes))
        log = packed.logs[b]
        if log is not None:
            # Calls the packed log dropped leave a gap the row's older entries cannot bridge.
            log = log.cleared() if dropped else log
            for i, entry in enumerate(held):
                back = len(held) - i  # calls from this entry's to now
                log = log.push(_row_entry(entry, b, offset - back, seen - back * H, pad))
        logs.append(log)
    return states, logs
