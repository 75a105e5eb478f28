"""The decode path's store for an evicting policy at its budget (:class:`Evicting`).

Each step writes the new token into the slot the last step freed (or the one ``evict_before``
frees), then the rule scores the candidates and picks the next dead slot, through the same two
compiled kernels every step (:mod:`velox_cache_core.fast_step`: the write, then the decision
and, on the CPU, the attention). A short chunk (a speculative verify chunk) is a loop of the
same step, traced into one call when the whole chunk stays steady.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core import fast_step
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.decode import raw_entries
from velox_cache_core.decode.store import Store
from velox_cache_core.engine import Step
from velox_cache_core.undo import UndoLog, puts_kernel
from velox_cache_core.validation import check_queries, check_scale


class Evicting(Store):
    """One layer's rows between decode steps of an evicting policy (see the module doc).

    keys/values ``[B, H_kv, S, D]``, positions int32 ``[B, H_kv, S]``, free int32 ``[B, H_kv]``
    (or ``None``) and running (the rule's running fields, flat, each ``[]`` for ``None`` or
    ``[value]``): the store as the last step left it. ``flight``: the token written and waiting
    for its queries (or a short chunk, ``chunk``); ``shared``: what the last step attended over
    (a layer sharing this one's keys and values attends over it again)."""

    __slots__ = (
        "ahead",
        "free",
        "kernels",
        "pins_at",
        "policy",
        "positions",
        "prefetch_next",
        "queries_rule",
        "running",
    )

    def __init__(
        self,
        policy: Any,
        state: Any,
        log: UndoLog | None,
        kernels: fast_step.Kernels,
        at_once: bool,
    ) -> None:
        super().__init__(state, log)
        slots = state.slots
        self.policy = policy
        self.kernels = kernels
        self.positions, self.free = slots.positions, slots.free
        self.running = fast_step.flat_running(state, kernels.running)
        self.pins_at = kernels.running.index("pins")  # the pinned spans, an input of every write
        self.prefetch_next = log is not None and policy.evict_before is not None
        self.ahead: list[mx.array] | None = None  # [slot, keys, values, positions]
        # the rule scores with the true queries (unless decided at once); on the CPU without
        # sinks the decision kernel attends too
        self.queries_rule = kernels.query_signal and not at_once

    @property
    def idle(self) -> bool:
        """Nothing in flight: no token or chunk waiting, no step decided whose attention may
        still come."""
        return self.flight is None and self.chunk is None and self.decided is None

    @property
    def in_flight(self) -> int:
        """Tokens laid out whose decision has not been taken (they count in the offset)."""
        if self.flight is not None:
            return 1
        return 0 if self.chunk is None else int(self.chunk[0].shape[2])

    def arrays(self) -> list[mx.array]:
        """The store's arrays (rows, positions, dead slot), to evaluate them in place."""
        out = [self.keys, self.values, self.positions]
        return out if self.free is None else [*out, self.free]

    # -- a decode token ---------------------------------------------------------------------------
    def fits(self, keys: Any, values: Any) -> bool:
        """Whether ``keys``/``values`` ``[B, H_kv, L, D]`` are full-precision arrays of a
        decode token's shapes but the row count ``L``, and dtypes (:attr:`token`)."""
        if keys.__class__ is not mx.array or values.__class__ is not mx.array:
            return False
        k_shape, v_shape, k_dtype, v_dtype = self.token
        L = keys.shape[2]
        return (keys.shape, values.shape, keys.dtype, values.dtype) == (
            (*k_shape[:2], L, k_shape[3]),
            (*v_shape[:2], L, v_shape[3]),
            k_dtype,
            v_dtype,
        )

    def write(
        self, keys: Any, values: Any, decide: bool = True, defer: bool = False
    ) -> tuple[Any, Any] | None:
        """Write the decode token ``keys``/``values`` ``[B, H_kv, 1, D]`` into its slot (the
        one the last step freed, or the one ``evict_before`` frees) as :attr:`flight`, the
        store unchanged until the decision; what the model attends over (the store with it,
        in slot order) out, or ``None`` when the step is not one this path takes (nothing
        changed). A step that does not wait for its queries is decided now (``decide``).

        ``defer``: the caller hands the returned arrays back to :meth:`attend` untouched
        (mlx-lm's attention through the hook), so a step that waits for its queries returns
        the token's own ``keys``/``values`` and writes it in :meth:`attend`, in the same
        compiled call as the decision (:func:`velox_cache_core.fast_step.steps_kernel`, one step):
        one compiled call a step instead of two, the same rows and decisions."""
        if not self.steady or not (self.flight is self.decided is self.chunk is None):
            return None  # not steady, or a call in flight
        if keys.__class__ is not mx.array or values.__class__ is not mx.array:
            return None
        if (keys.shape, values.shape, keys.dtype, values.dtype) != self.token:
            return None  # not a token of the store's shape and dtype (self.fits, inlined)
        deferring = defer and decide and self.kernels.waits
        k, v = self._lay(keys, values, deferring)
        self.ahead = self.shared = self.decided = None
        mirror = self.mirror
        if mirror is not None:
            mirror["offset"] = self.offset + 1
        if decide:  # a decode token, not one of a chunk's
            self.stepped = []
        if self.kernels.waits or not decide:  # a deferred step waits for its queries too
            return k, v
        own = 1.0 / math.sqrt(int(keys.shape[3]))
        values_out, _, probs = self._decide(None, (own, False, None))
        self.decided = Step(k, values_out, None, None, probs=probs)
        return k, values_out

    def _lay(self, keys: mx.array, values: mx.array, deferring: bool) -> tuple[Any, Any]:
        """The token as :attr:`flight`: written into its slot by the write kernel now, or
        (``deferring``) with the write's inputs kept for :meth:`attend`; what the model gets
        back (the store with the token, or the token itself)."""
        ahead = self.ahead
        prefetched = ahead is not None
        free = [] if self.free is None else [self.free]
        if ahead is not None:  # evict_before's slot and its row, read by the step before
            free = [ahead[0]]
        start = mx.array(self.offset, dtype=mx.int32)
        if deferring:
            self.deferred = (free, prefetched)
            self.flight = (keys, values, None, None, None, None, ahead and ahead[1:], start)
            return keys, values
        kernel = self.kernels.write.get(prefetched) or self._compile_write(prefetched)
        pins = self.running[self.pins_at]
        k, v, p, written, row = kernel(
            self.keys, self.values, self.positions, free, keys, values, start, pins
        )
        if ahead is not None:
            row = ahead[1:]
        self.flight = (keys, values, k, v, p, written, row or None, start)
        return k, v

    def _compile_write(self, prefetched: bool) -> Any:
        made = fast_step.write_kernel(self.policy, self.template, prefetched=prefetched)
        kernel = self.kernels.write[prefetched] = mx.compile(made)
        return kernel

    def attend(self, queries: Any, scale: Any, sinks: mx.array | None) -> mx.array | None:
        """``[B, H_q, 1, D]``: the token in flight decided with ``queries`` and attended (or,
        decided at lay-out, attended); ``None`` when nothing of this path is in flight.
        ``TypeError``/``ValueError`` on bad queries or scale, nothing changed."""
        flight = self.flight
        if flight is None:
            decided = self.decided
            if decided is not None:
                self.decided = None
                self.shared = (decided.keys, decided.values)
                return attend_step(queries, decided, scale, sinks)
            return self._attend_again(queries, scale, sinks)
        keys = flight[0]
        if queries.__class__ is not mx.array or queries.ndim != 4:
            check_queries(queries, keys)
        B, H, L, D = keys.shape
        qB, qH, qL, qD = queries.shape
        if not (qB == B and qL == L and qD == D and qH % H == 0):
            check_queries(queries, keys)  # raises, naming what differs
        if scale.__class__ is not float or not 0.0 < scale < math.inf:
            scale = check_scale(scale, int(D))
        here = sinks is None and self.here
        if self.queries_rule:
            given, settings = queries, (scale, here, None)
        else:
            own = 1.0 / math.sqrt(int(D))
            given, settings = (queries if here else None), (own, here, scale)
        values, out, probs = self._decide(given, settings)
        self.shared = (self.keys, values)
        if out is not None:
            return out
        return attend_step(queries, Step(self.keys, values, None, None, probs=probs), scale, sinks)

    def _attend_again(self, queries: Any, scale: Any, sinks: mx.array | None) -> mx.array | None:
        """A layer sharing this one's keys and values attends over what the last step (or
        each step of the last chunk) attended over; ``None`` when nothing was."""
        shared = self.shared
        if shared is not None:
            return attend_step(queries, Step(shared[0], shared[1], None, None), scale, sinks)
        if self.stepped:
            outs = [
                attend_step(queries[:, :, a:b], replace(step, probs=None), scale, sinks)
                for a, b, step in self.stepped
            ]
            return mx.concatenate(outs, axis=2)
        return None

    def _decide(
        self, queries: mx.array | None, settings: tuple[float, bool, float | None]
    ) -> tuple[Any, mx.array | None, mx.array | None]:
        """Decide the token in flight with the decision kernel of ``settings`` and take the
        decision (:meth:`_take`). Returns (the values to attend over, the attention output when
        the kernel attended, the query's weights when the rule computed them)."""
        flight = self.flight
        assert flight is not None
        keys, values, k, v, p, written, row, start = flight
        full = (*settings, self.prefetch_next, queries is None)
        query = [] if queries is None else [queries]
        if k is None:  # a deferred write: the write and the decision in one call
            assert self.deferred is not None
            free, prefetched = self.deferred
            self.deferred = None
            key = ("steps", 1, prefetched, *full)
            kernel, same = self.kernels.decide.get(key) or self._compile_steps(key)
            [(wrote, outputs)] = kernel(
                self.keys,
                self.values,
                self.positions,
                free,
                keys,
                values,
                query,
                start,
                self.running,
            )
            k, v, p, written, made_row = wrote
            flight = self.flight = (keys, values, k, v, p, written, row or made_row or None, start)
            return self._take(flight, outputs, same)
        kernel, same = self.kernels.decide.get(full) or self._compile_decide(full)
        outputs = kernel(k, v, p, written, keys, values, query, start, self.running)
        return self._take(flight, outputs, same)

    def _compile_steps(self, key: tuple[Any, ...]) -> tuple[Any, list[bool]]:
        """Trace and compile the kernel of ``L`` steps in one call (``key``: ``("steps", L,
        prefetched, *the decision kernel's key)``; :func:`velox_cache_core.fast_step.
        steps_kernel`) and keep it in ``Kernels.decide`` with an empty record."""
        _, L, prefetched, *full = key
        kernels = self.kernels
        traced = fast_step.steps_kernel(
            self.policy, self.template, kernels, tuple(full[:4]), L, prefetched
        )
        found = kernels.decide[key] = (mx.compile(traced), [])
        return found

    def _compile_decide(self, full: tuple[Any, ...]) -> tuple[Any, list[bool]]:
        kernels = self.kernels
        made = fast_step.decide_kernel(
            self.policy, self.template, kernels.running, kernels.key[2], full[:4]
        )
        found = kernels.decide[full] = (mx.compile(made), [])
        return found

    def _take(
        self, flight: tuple[Any, ...], outputs: Any, same: list[bool]
    ) -> tuple[Any, mx.array | None, mx.array | None]:
        """Take a step's decision (``outputs``: the decision kernel's): the store becomes the
        candidates less the new dead slot, the undo entry is kept raw, and the rows the log
        and the next write read are tied to the step's output (read before the next step
        overwrites them)."""
        _, _, k, v, p, written, row, _ = flight
        kernels = self.kernels
        self.flight = self.ahead = None
        free, victim, changes, probs, out, ahead, pushed = outputs
        entries = self.entries
        values = v
        if entries is not None:
            read = self._record(entries, written, row, victim, pushed)
            if ahead:
                self.ahead = ahead
                read = [*read, *ahead]
            if read and out:
                out = [mx.depends(out, read)[0]]
            elif read:
                values = mx.depends([v], read)[0]
        self.keys, self.values, self.positions = k, v, p
        self.free = free[0] if free else None
        self.running = changes
        self.offset += 1
        self.tokens_seen += self.heads
        if not same:  # first call of this kernel: do its running fields keep their kinds?
            same.append(fast_step.kinds_after(changes) == kernels.key[2])
        if not same[0] or (self.free is None and self.policy.evict_before is None):
            self.steady = False  # the next step is checked again on the general side
        return values, (out[0] if out else None), (probs[0] if probs else None)

    def _record(
        self, entries: Any, written: Any, row: Any, victim: Any, pushed: list[list[mx.array]]
    ) -> list[mx.array]:
        """Keep the step's raw undo entry (the previous one's histories made compact, from the
        rows its kernel copied); the arrays the step's output must read."""
        counters = (self.offset, self.tokens_seen, self.running, self.free)
        raw: raw_entries.Raw = (*counters, written, row, victim, pushed)
        entries.append(raw)
        if len(entries) == entries.maxlen:
            self.base_log = None  # the log now holds only these (see cool)
        read = victim if row is None else [*victim, *row]
        if pushed:
            read = [*read, *(a for rows in pushed for a in rows)]
            if len(entries) > 1:
                entries[-2] = raw_entries.compact(self.kernels, entries[-2])
        return list(read)

    # -- a trim within the steps taken here ---------------------------------------------------
    def trim(self, n: int) -> bool:
        """Take back the last ``n`` decode steps in place, as the general path's trim does
        (:func:`velox_cache_core.undo.trim`: each step's overwritten row, or the row the step
        before it evicted, put back in its slot; the dead slot, running fields and counters as
        they were before the oldest); ``False`` (nothing changed) when the store cannot: a call
        in flight, no undo log, running histories, or fewer raw entries here than ``n + 1``
        (the step before the oldest names the row its dead slot held)."""
        entries = self.entries
        if n == 0:
            return True
        if (
            entries is None
            or n >= len(entries)
            or not self.idle
            or not self.steady
            or self.kernels.histories
        ):
            return False
        raws = [entries[-1 - i] for i in range(n + 1)]  # newest first, and the one before
        slots, rows = [], []
        for raw, before in itertools.pairwise(raws):
            row = raw[5] or before[6]
            if row:  # else the slot was dead and stays dead
                slots.append(raw[4])
                rows.append(list(row))
        if slots:
            kernel = puts_kernel(len(slots))
            self.keys, self.values, self.positions = kernel(
                self.keys, self.values, self.positions, slots, rows
            )
        oldest = raws[n - 1]
        self.offset, self.tokens_seen, self.running, self.free = oldest[:4]
        self.drop_as_pushed()
        for _ in range(n):
            entries.pop()
        self.ahead = self.shared = None
        self.stepped = []
        if self.mirror is not None:
            self.mirror["offset"] = self.offset
        return True

    # -- a short chunk, as that many decode steps ---------------------------------------------
    def lay_out_chunk(self, keys: Any, values: Any) -> tuple[Any, Any] | None:
        """A short chunk ``[B, H_kv, L, D]`` that waits for its queries to run as ``L`` decode
        steps: ``retained + new`` out, or ``None`` when this path does not take it."""
        if not self.steady or self.decided is not None or not self.fits(keys, values):
            return None
        self.chunk = (keys, values)
        self.shared = self.decided = None
        if self.mirror is not None:
            self.mirror["offset"] = self.offset + int(keys.shape[2])
        self.stepped = []
        store = fast_step.slots_of(self.keys, self.values, self.positions, self.free)
        return fast_step.retained_plus_new(store, keys, values)

    def attend_chunk(
        self, queries: Any, scale: Any, sinks: mx.array | None
    ) -> tuple[list[mx.array], int]:
        """The chunk's tokens written, decided and attended one at a time with their own
        queries (one compiled call when the whole chunk stays steady): the outputs
        ``[B, H_q, 1, D]`` of the tokens taken and how many were taken (the rest is the
        general path's, from a token whose step this path does not take)."""
        chunk = self.chunk
        assert chunk is not None
        keys, values = chunk
        check_queries(queries, keys)
        scale = check_scale(scale, int(keys.shape[3]))
        self.chunk = None
        L = int(keys.shape[2])
        here = sinks is None and self.here
        D = int(keys.shape[3])
        if self.queries_rule:
            given, settings = queries, (scale, here, None)
        else:
            given, settings = (queries if here else None), (1.0 / math.sqrt(D), here, scale)
        outs = self._run_steps(keys, values, given, settings)
        if outs is not None:
            return self._attended(outs, queries, scale, sinks), L
        taken: list[mx.array | None] = []
        for i in range(L):
            k_i = mx.contiguous(keys[:, :, i : i + 1])
            v_i = mx.contiguous(values[:, :, i : i + 1])
            if self.write(k_i, v_i, decide=False) is None:
                break
            q_i = mx.contiguous(queries[:, :, i : i + 1])
            step_given = None if given is None else q_i
            taken.append(self._step_out(self._decide(step_given, settings)))
        return self._attended(taken, queries, scale, sinks), len(taken)

    def _step_out(self, decided: tuple[Any, Any, Any]) -> Any:
        """Keep a chunk's step (the store it attended over, for query row ``i``, its ``i``-th)
        in :attr:`stepped`; its output."""
        values, out, probs = decided
        i = len(self.stepped)
        self.stepped.append((i, i + 1, Step(self.keys, values, None, None, probs=probs)))
        return out

    def _attended(
        self, outs: list[mx.array | None], queries: mx.array, scale: float, sinks: Any
    ) -> list[mx.array]:
        """Each taken step's output, attending those whose kernel did not."""
        return [
            attend_step(mx.contiguous(queries[:, :, a:b]), step, scale, sinks)
            if out is None
            else out
            for out, (a, b, step) in zip(outs, self.stepped, strict=True)
        ]

    def _run_steps(
        self,
        keys: mx.array,
        values: mx.array,
        queries: mx.array | None,
        settings: tuple[float, bool, float | None],
    ) -> list[mx.array | None] | None:
        """The chunk's steps traced into one compiled call: each step's output, or ``None``
        when a step of the chunk would leave the steady state (nothing changed)."""
        L = int(keys.shape[2])
        full = (*settings, self.prefetch_next, queries is None)
        key = ("steps", L, self.ahead is not None, *full)
        kernel, steady = self.kernels.decide.get(key) or self._compile_steps(key)
        if steady == [False]:
            return None
        ahead = self.ahead
        first_free = [] if self.free is None else [self.free]
        if ahead is not None:  # evict_before's slot, read by the step before
            first_free = [ahead[0]]
        try:
            per_step = kernel(
                self.keys,
                self.values,
                self.positions,
                first_free,
                keys,
                values,
                [] if queries is None else [queries],
                mx.array(self.offset, dtype=mx.int32),
                self.running,
            )
        except fast_step.NotSteady:
            steady.append(False)
            return None
        outs = []
        row = None if ahead is None else ahead[1:]
        self.ahead = None
        for wrote, decided in per_step:
            k, v, p, written_slot, row_arrays = wrote
            self.flight = (None, None, k, v, p, written_slot, row_arrays or row, None)
            outs.append(self._step_out(self._take(self.flight, decided, [True])))
            row = None if self.ahead is None else self.ahead[1:]
        return outs

    # -- back to a frozen state ---------------------------------------------------------------
    def cool(self) -> tuple[Any, UndoLog | None, tuple[Any, Any] | None, Step | None]:
        """(the frozen state, the undo log, the token or chunk laid out and still waiting for
        its queries (keys, values) or ``None``, the step decided at lay-out whose attention
        has not come or ``None``): what the general path holds for this layer now."""
        kernels = self.kernels
        log = self.leave(functools.partial(raw_entries.entry, kernels))
        state = fast_step.state_of(
            self.template,
            kernels,
            fast_step.slots_of(self.keys, self.values, self.positions, self.free),
            self.offset,
            self.tokens_seen,
            self.running,
        )
        waiting = None
        if self.flight is not None:
            waiting = (self.flight[0], self.flight[1])
        elif self.chunk is not None:
            waiting = self.chunk
        decided = self.decided
        if decided is not None:
            decided = Step(decided.keys, decided.values, None, state, log, probs=decided.probs)
        return state, log, waiting, decided
