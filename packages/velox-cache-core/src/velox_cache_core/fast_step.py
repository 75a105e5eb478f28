"""The decode path's compiled kernels: a steady decode step as two ``mx.compile``d kernels.

At the budget, a decode step of an evicting policy does the same thing every token: the new
token goes into the slot the last step freed (or, for StreamingLLM, the oldest one), the rule
scores the candidates and picks the next dead slot, and the undo log records the row that will
be overwritten. Built op by op from Python, that is about 40 MLX calls per layer per token.

Here the step is traced once per (policy settings, shapes, scale) through the *same* code the
general path runs (:func:`velox_cache_core.store.slots.KVSlots.write_free`, the policy's
``evict_before`` and ``rule``, the victim gather of :mod:`velox_cache_core.undo`) and replayed
by ``mx.compile``: :func:`write_kernel` (the token into its slot), :func:`decide_kernel` (the
rule's decision and, on the CPU, the attention) and :func:`steps_kernel` (a short chunk's steps
traced in turn into one graph). The decisions, the stored rows and the undo entries are the
general path's, bit for bit (``tests/test_fast_step.py`` checks it per policy). The store
that runs them, step after step, is :mod:`velox_cache_core.decode`.

A policy opts in with ``Policy.compiled_decode``: its decode rule and ``evict_before`` read the
state only through settings and array running fields (never an int counter, which a trace would
freeze), and positions only through ``Call.positions``/``Call.newest``.

Which states the kernels take (:func:`eligible`): full-precision rows held as one uniform store
(no lanes: ``allocation="uniform"``), after the prompt (no held prompt), with a dead slot to
write into or an ``evict_before`` that frees one. :func:`appends` names the states whose steps
only append (SnapKV after its cut). Everything else takes the general path, which stays the
reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend_row, weights_times_values
from velox_cache_core.declarations import running_fields, setting_fields
from velox_cache_core.engine import Call
from velox_cache_core.history import History, pushed_out
from velox_cache_core.policy import Policy
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import running_names

Kernel = Callable[..., Any]

# ``VELOX_FAST_DECODE=0`` sends every step down the general path (to compare, or to debug)
ENABLED = os.environ.get("VELOX_FAST_DECODE", "1") != "0"

# running fields every state has, and the ones the fast path never sees set
_COUNTERS = ("offset", "tokens_seen")
_STORE = ("slots", "lanes")


@cache
def _state_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(settings, running fields the rule may read) of a state type."""
    running = tuple(n for n in running_fields(cls) if n not in _COUNTERS + _STORE)
    return setting_fields(cls), running


def _running_kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, mx.array):
        return "array"
    if isinstance(value, History):
        return "history"
    return "other"


@dataclass(eq=False, slots=True)
class Kernels:
    """What a kernel key (policy, settings, running fields' kinds, whether the step waits for
    its queries) needs per step, looked up once per key rather than per step: the compiled
    kernels, built on first use, and the state's field names. One object per key, shared by
    every layer whose steps have it (:func:`eligible` returns it)."""

    key: tuple[Any, ...]
    waits: bool  # the step waits for its queries
    query_signal: bool  # the rule scores with the true queries (a setting: part of the key)
    running: tuple[str, ...]  # running fields the rule may read (kernel inputs and outputs)
    undo_names: tuple[str, ...]  # running fields an undo entry keeps
    write: dict[bool, Kernel]  # by "the row to overwrite was prefetched"
    # by (scale, attend_here, attend_scale, prefetch_next, no queries): the kernel, and whether
    # the running fields it returns keep their kinds (the output structure is the trace's);
    # and steps_kernel's, by ("steps", L, prefetched, ...): for a chunk (L > 1) the kernel and
    # [False] once its trace found a step of the chunk leaving the steady state, for a deferred
    # decode step (L = 1) the kernel and the kinds record, as a decision kernel's
    decide: dict[tuple[Any, ...], tuple[Kernel, list[bool]]]
    histories: tuple[int, ...] = ()  # indices of the running fields that are histories


_KERNELS: dict[tuple[Any, ...], Kernels] = {}


def eligible(policy: Policy, state: Any, *, queries_needed: bool) -> Kernels | None:
    """The :class:`Kernels` of ``state``'s next decode step when the fast path can take it (see
    the module doc), else ``None``. ``queries_needed``: the step will wait for its queries."""
    if not policy.compiled_decode:
        return None
    slots = state.slots
    if slots is None or state.lanes is not None or state.holds_prompt:
        return None
    if slots.free is None:  # an evict_before frees a slot once the store holds the budget
        budget = policy.traits.budget(state)
        if policy.evict_before is None or budget is None or slots.n_slots < budget:
            return None
    if not isinstance(slots.keys, mx.array) or not isinstance(slots.values, mx.array):
        return None
    settings, running = _state_fields(state_type(state))
    kinds = tuple(_running_kind(getattr(state, name)) for name in running)
    if "other" in kinds:
        return None
    values = tuple(getattr(state, name) for name in settings)
    key = (policy.name, values, kinds, queries_needed)
    found = _KERNELS.get(key)
    if found is None:
        found = _KERNELS[key] = _kernels(policy, state, key, running)
    return found


def _kernels(policy: Policy, state: Any, key: tuple[Any, ...], running: tuple[str, ...]) -> Kernels:
    """The :class:`Kernels` of a new key (``eligible``)."""
    names = running_names(state_type(state))
    query = policy.traits.signal(state) == "query"
    histories = tuple(i for i, kind in enumerate(key[2]) if kind == "history")
    return Kernels(key, key[3], query, running, names, {}, {}, histories)


def appends(policy: Policy, state: Any) -> bool:
    """Whether ``state``'s next decode step only appends its token, in place, into reserved
    rows (``Policy.appends_now``: SnapKV after its cut), with nothing to decide."""
    check = policy.appends_now
    slots = state.slots
    if check is None or slots is None or state.lanes is not None or slots.free is not None:
        return False
    return slots.has_room(1) and bool(check(state))


def _flat(value: Any) -> Any:
    return (value.probes, value.positions) if isinstance(value, History) else value


def _unflat(kind: str | None, value: Any) -> Any:
    # an undo entry's history may be kept compact (velox_cache_core.history.HistoryBefore)
    return History(*value) if kind == "history" and value.__class__ is tuple else value


def write_kernel(policy: Policy, template: Any, *, prefetched: bool) -> Kernel:
    def kernel(
        keys: mx.array,
        values: mx.array,
        positions: mx.array,
        free: list[mx.array],
        new_keys: mx.array,
        new_values: mx.array,
        start: mx.array,
        pins: list[mx.array],
    ) -> Any:
        row: list[mx.array] = []
        if prefetched:  # evict_before's slot, and its row, read by the step before
            slots = KVSlots(keys, values, positions, free[0])
            laid = slots.write_free(new_keys, new_values, start)
            return laid.keys, laid.values, laid.positions, free[0], row
        before = KVSlots(keys, values, positions, free[0] if free else None)
        slots = before
        if policy.evict_before is not None:
            call = Call(new_keys, new_values, None, 1.0, start)  # type: ignore[arg-type]
            # the pinned spans are an input (a running array), the settings the trace's
            state = replace(template, pins=pins[0]) if pins else template
            slots = policy.evict_before(state, before, call)
        assert slots.free is not None
        laid = slots.write_free(new_keys, new_values, start)
        if slots.free is not before.free:  # a live row freed now: the undo log keeps it
            row = _rows_at(before, slots.free)
        return laid.keys, laid.values, laid.positions, slots.free, row

    return kernel


class NotSteady(Exception):
    """Raised while tracing :func:`steps_kernel`: a step of the chunk would leave the steady
    state (no slot to write the next token into, or running fields changing kind)."""


def steps_kernel(
    policy: Policy,
    template: Any,
    kernels: Kernels,
    settings: tuple[float, bool, float | None, bool],
    L: int,
    prefetched_first: bool,
) -> Kernel:
    """``L`` write kernels and decision kernels in turn, as :func:`run_steps` takes them: each
    step's (write outputs, decision outputs). With ``L = 1`` it is one decode step's write and
    decision in one call (a deferred write,
    :meth:`velox_cache_core.decode.evicting.Evicting.write`), the token's rows as given."""
    kinds = kernels.key[2]
    decide_one = decide_kernel(policy, template, kernels.running, kinds, settings)
    writes = {flag: write_kernel(policy, template, prefetched=flag) for flag in (False, True)}
    pins_at = kernels.running.index("pins")  # the pinned spans, an input of every write

    def kernel(
        keys: mx.array,
        values: mx.array,
        positions: mx.array,
        free: list[mx.array],
        new_keys: mx.array,
        new_values: mx.array,
        query: list[mx.array],
        start: mx.array,
        old: list[list[Any]],
    ) -> Any:
        per_step = []
        prefetched = prefetched_first
        for i in range(L):
            k_i, v_i, q_i = new_keys, new_values, query
            if L > 1:
                k_i = mx.contiguous(new_keys[:, :, i : i + 1])
                v_i = mx.contiguous(new_values[:, :, i : i + 1])
                q_i = [mx.contiguous(q[:, :, i : i + 1]) for q in query]
            at = start if i == 0 else start + i  # no node for step 0
            wrote = writes[prefetched](keys, values, positions, free, k_i, v_i, at, old[pins_at])
            keys, values, positions, written, _ = wrote
            decided = decide_one(keys, values, positions, written, k_i, v_i, q_i, at, old)
            next_free, _, changes, _, _, ahead, _ = decided
            per_step.append((wrote, decided))
            if i == L - 1:
                break
            if kinds_after(changes) != kinds:
                raise NotSteady  # a running field changes kind: another kernel key
            prefetched = bool(ahead)
            free = [ahead[0]] if ahead else next_free
            if not free and policy.evict_before is None:
                raise NotSteady  # nothing frees a slot for the next token
            old = changes
        return per_step

    return kernel


def kinds_after(changes: list[list[Any]]) -> tuple[str | None, ...]:
    """The kinds of a decision kernel's running fields (flat: a history is a tuple)."""
    return tuple(
        None if not c else "history" if isinstance(c[0], tuple) else _running_kind(c[0])
        for c in changes
    )


def decide_kernel(
    policy: Policy,
    template: Any,
    running: tuple[str, ...],
    kinds: tuple[str | None, ...],
    settings: tuple[float, bool, float | None, bool],
) -> Kernel:
    scale, attend_here, attend_scale, prefetch_next = settings
    histories = [i for i, kind in enumerate(kinds) if kind == "history"]

    def kernel(
        keys: mx.array,
        values: mx.array,
        positions: mx.array,
        written: mx.array,
        new_keys: mx.array,
        new_values: mx.array,
        query: list[mx.array],
        start: mx.array,
        old: list[list[Any]],
    ) -> Any:
        given = [v[0] if v else None for v in old]
        state = replace(
            template,
            **{n: _unflat(k, v) for n, k, v in zip(running, kinds, given, strict=True)},
        )
        queries = query[0] if query else None
        call = Call(new_keys, new_values, queries, scale, start)  # type: ignore[arg-type]
        candidates = KVSlots(keys, values, positions)
        # the slots the call wrote into: the rule reads only their dead slot (H2O's aligned sums)
        slots = KVSlots(keys, values, positions, written)
        decision = policy.rule(state, call, slots, candidates)
        kept = decision.kept
        if kept.keys is not candidates.keys:
            raise NotImplementedError(f"{policy.name}: a decode step that reorders its slots")
        victim: list[Any] = [] if kept.free is None else _rows_at(candidates, kept.free)
        changes: list[list[Any]] = []
        for name in running:
            value = _flat(decision.changes.get(name, getattr(state, name)))
            changes.append([] if value is None else [value])
        out: list[mx.array] = []
        if attend_here and decision.probs is not None:
            assert queries is not None
            out = [weights_times_values(decision.probs, values, queries.dtype)]
        elif attend_here and queries is not None:  # decided without them: attend here too
            own = scale if attend_scale is None else attend_scale
            out = [attend_row(queries, keys, values, own)]
        free = [] if kept.free is None else [kept.free]
        probs_out = [] if decision.probs is None else [decision.probs]
        ahead: list[mx.array] = []
        if prefetch_next and policy.evict_before is not None and kept.free is None:
            after = Call(new_keys, new_values, None, 1.0, start + 1)  # type: ignore[arg-type]
            nxt = policy.evict_before(state, KVSlots(keys, values, positions), after)
            if nxt.free is not None:
                ahead = [nxt.free, *_rows_at(candidates, nxt.free)]
        pushed = [_pushed_out(old[i], changes[i]) for i in histories]
        return free, victim, changes, probs_out, out, ahead, pushed

    return kernel


def _pushed_out(before: list[Any], after: list[Any]) -> list[mx.array]:
    """A decode step's :func:`velox_cache_core.history.pushed_out` of a history (flat,
    ``before`` the step and ``after`` it), as arrays: what an undo entry keeps of ``before``,
    made in the kernel rather than by slicing on the host every step (``[]``: none, the entry
    keeps ``before`` whole)."""
    if not before or not after:
        return []
    dropped = pushed_out(History(*before[0]), after[0][0].shape[2], 1)
    return [] if dropped is None else [dropped.probes, dropped.positions]


def state_type(state: Any) -> Any:
    """``type(state)``, typed as ``Any`` (a cache key for the ``functools.cache``d lookups)."""
    return type(state)


def _rows_at(slots: KVSlots, slot: mx.array) -> list[mx.array]:
    """Row ``slot`` (int ``[B, H_kv]``) of every head, as the undo log takes it
    (``KVSlots.take``): keys, values ``[B, H_kv, 1, *]`` and positions ``[B, H_kv, 1]``."""
    return slots.take(slot[..., None]).arrays()


def slots_of(
    keys: mx.array, values: mx.array, positions: mx.array, free: mx.array | None = None
) -> KVSlots:
    """A store of these rows (dead slot ``free``, or none)."""
    return KVSlots(keys, values, positions, free)


def flat_running(state: Any, names: tuple[str, ...]) -> list[list[Any]]:
    """``state``'s running fields ``names`` as the kernels take them: each ``[]`` for ``None``
    or ``[value]``, a history flat (a tuple of arrays)."""
    return [[] if (v := getattr(state, name)) is None else [_flat(v)] for name in names]


def unflat_running(kernels: Kernels, running: list[list[Any]]) -> list[Any]:
    """The kernels' running fields back as the state holds them."""
    return [_unflat(k, v[0]) if v else None for k, v in zip(kernels.key[2], running, strict=True)]


def state_of(
    template: Any,
    kernels: Kernels,
    slots: KVSlots,
    offset: int,
    tokens_seen: int,
    running: list[list[Any]],
) -> Any:
    """A frozen state like ``template`` holding these rows, counters and running fields."""
    fields = dict(zip(kernels.running, unflat_running(kernels, running), strict=True))
    return replace(template, slots=slots, offset=offset, tokens_seen=tokens_seen, **fields)


def _joined_kernel(
    keys: Any,
    values: Any,
    positions: mx.array,
    free: mx.array | None,
    new_keys: Any,
    new_values: Any,
) -> tuple[Any, Any]:
    """``retained + new``: the live rows of a store with a dead slot, then a call's rows."""
    live = KVSlots(keys, values, positions, free).compact()
    return rows.concat([live.keys, new_keys], axis=2), rows.concat(
        [live.values, new_values], axis=2
    )


_joined = mx.compile(_joined_kernel)


def retained_plus_new(slots: KVSlots, keys: Any, values: Any) -> tuple[Any, Any]:
    """``retained + new``: ``slots``' live rows, then a call's ``keys``/``values``
    ``[B, H_kv, L, D]`` (what a call that waits for its queries hands the model). With a dead
    slot and full-precision rows (a verify chunk at the budget), one compiled call."""
    if slots.free is not None and all(
        isinstance(a, mx.array) for a in (slots.keys, slots.values, keys, values)
    ):
        return _joined(slots.keys, slots.values, slots.positions, slots.free, keys, values)
    live = slots.compact()
    return rows.concat([live.keys, keys], axis=2), rows.concat([live.values, values], axis=2)
