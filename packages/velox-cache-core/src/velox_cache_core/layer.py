"""One layer's cache lifecycle: the policy, its state, the undo log and the call in flight.

A framework's attention layer drives a :class:`Layer` with three explicit operations:

1. :meth:`Layer.lay_out` ``(keys, values)``: the call's rotated keys and values; returns what
   the model attends over (``retained + new``). Depending on the :class:`Mode` and the call,
   the decision is taken now or waits for the queries.
2. :meth:`Layer.attend` ``(queries, scale)``: settle the call with the true queries and return
   the attention output (the policy's masks applied).
3. :meth:`Layer.settle`: settle it without them (the queries never came: signal ``key`` stands
   in, with a warning), or :meth:`Layer.finish` with the tensor-parallel group's sums.

The mode is chosen once, by whoever knows how attention reaches the layer:

- ``AT_ONCE``: every call is decided in ``lay_out`` (the model attends by itself, over what
  ``lay_out`` returned; the states must not score by the true queries);
- ``QUERIES`` (the default, correct with or without a hook): a call that needs the queries
  waits for ``attend``; one that never gets them is settled without them at the next call;
- ``STEP_SUMS``: as ``QUERIES``, and a decode step's layer-wide sums go out with the other
  layers' in one ``all_sum`` per forward pass (:class:`velox_cache_core.distributed.StepSums`).

At most one thing is pending: a call :class:`Waiting` for its queries, one :class:`Decided` at
once whose attention may still come, or a decode step :class:`Deferred` until the pass's sums
arrive. Reading stats (:meth:`Layer.view`) never enters a collective. A policy's model-driven
phase (:class:`velox_cache_core.declarations.Compressor`) runs through :meth:`Layer.start_phase`.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core import (
    between_calls,
    demoted,
    in_flight,
    model_shares,
    phase,
    step_sums,
    waiting,
    without_queries,
)
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.decode import Hot, switch
from velox_cache_core.distributed import StepSums, summing_over
from velox_cache_core.engine import Step
from velox_cache_core.in_flight import (
    Decided,
    Deferred,
    Mode,
    Pending,
    Waiting,
)
from velox_cache_core.phase import Phase
from velox_cache_core.policy import Policy
from velox_cache_core.store import rows
from velox_cache_core.store.tier import Tier, TierSpec
from velox_cache_core.store.token_rows import Quant
from velox_cache_core.undo import UndoLog
from velox_cache_core.validation import check_fits


class Layer:
    """One layer's cache: ``policy``, ``state`` (its frozen core state), ``log`` (undo log or
    ``None``), the ``mode`` and the call in flight (``pending``).

    ``group``: the tensor-parallel group layer-wide decisions sum over (``None``: one
    process); ``sums``/``index``: the model's :class:`StepSums` and this layer's index in it
    (mode ``STEP_SUMS``). ``quant``: store the rows quantized
    (:class:`~velox_cache_core.store.token_rows.Quant`): each call's keys and values are
    quantized as they arrive, so what the queries attend over and what the policy scores are
    the same quantized rows. ``demote``: keep the rows the policy evicts in a tier at fewer
    bits (:class:`~velox_cache_core.store.tier.TierSpec`, :mod:`velox_cache_core.demoted`).
    """

    def __init__(
        self,
        policy: Policy,
        state: Any,
        log: UndoLog | None,
        *,
        mode: Mode = Mode.QUERIES,
        group: Any = None,
        quant: Quant | None = None,
        demote: TierSpec | None = None,
    ) -> None:
        if quant is not None and not isinstance(quant, Quant):
            raise TypeError(f"quant must be a Quant or None, got {type(quant).__name__}")
        if not isinstance(mode, Mode):
            raise TypeError(f"mode must be a Mode ({[m.name for m in Mode]}), got {mode!r}")
        if mode is Mode.STEP_SUMS:
            raise ValueError("mode STEP_SUMS is set by share_step_sums(sums, index)")
        if mode is Mode.AT_ONCE and policy.traits.signal(state) == "query":
            fix = "needs signal='key'" if "signal" in state.settings else "needs them"
            raise ValueError(f"mode AT_ONCE decides without the queries: {policy.name} {fix}")
        self.policy = policy
        # decoding: the rows live in the decode path's mutable store, and state, log and
        # pending are built from it when read (velox_cache_core.decode)
        self.hot: Hot | None = None
        self._state = state
        self._log = log
        self._pending: Pending = None
        self.mode: Mode = mode
        self.group = group
        self.quant = quant
        self.demote = demoted.check(policy, state, mode, demote)
        self.tier: Tier | None = None  # the demoted rows (velox_cache_core.demoted)
        self.shared_tier: Tier | None = None  # the tier the last call attended
        self.tier_undo: demoted.TierUndo | None = None  # the tier before the last call (trims)
        self.sums: StepSums | None = None
        self.index = 0
        self.phase: Phase | None = None
        # what the last lay_out returned, and the step its attention used: a layer sharing
        # this one's keys and values (KV sharing) attends over them again
        self.fetched: tuple[rows.Rows, rows.Rows] | None = None
        self.last: Step | None = None
        # the model layer this one serves, named in errors (set by whoever builds it)
        self.serves: str | None = None
        # every call must come back through attend (a cache the builder nested in a model's
        # cache list: used outside attention, it could not evict consistently)
        self.must_attend = False
        # the model's layers sharing a global allocation (velox_cache_core.model_shares)
        self.shares: Any = None
        # the last call was a short chunk run as decode steps: the query rows [a, b) of each
        # step, for a layer sharing this one's keys and values
        self._stepped: list[tuple[int, int, Step]] = []

    # -- copies: arrays are immutable, so a copy shares them; group and sums are shared ----------
    def __copy__(self) -> Layer:
        if self.hot is not None:  # a copy shares no mutable store
            switch.cool(self)
        out = Layer.__new__(Layer)
        out.__dict__.update(self.__dict__)
        out.phase = None if self.phase is None else copy.copy(self.phase)
        # a lone copy is not one of the model's linked layers (a copy of them all, by
        # copy.deepcopy of the list, links the copies: __deepcopy__)
        out.shares = None
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Layer:
        out = copy.copy(self)
        memo[id(self)] = out  # the shares' copy links this copy, not this layer
        for name in ("_state", "_log", "_pending", "phase", "shares"):
            setattr(out, name, copy.deepcopy(getattr(self, name), memo))
        return out

    # -- wiring (the builder decides the mode once) --------------------------------------------
    connect = step_sums.connect
    share_step_sums = step_sums.share_step_sums

    # -- the state, its undo log and the call in flight (built from the decode path's rows) ---
    state = switch.Cooled(
        "The policy's frozen state (the decode path's rows, frozen, when decoding)."
    )
    log = switch.Cooled("The undo log (``None``: the layer keeps none).")

    @property
    def keeps_log(self) -> bool:
        """Whether the layer keeps an undo log (read without leaving the decode path)."""
        hot = self.hot
        return self._log is not None if hot is None else hot.entries is not None

    @property
    def pending(self) -> Pending:
        """The call in flight, if any."""
        hot = self.hot
        if hot is not None and not hot.idle:
            switch.cool(self)
        return self._pending

    @pending.setter
    def pending(self, value: Pending) -> None:
        if value is not None and self.hot is not None:
            switch.cool(self)
        self._pending = value

    @property
    def fast_path(self) -> bool:
        """Whether this layer's next decode step (a token of the store's shape, nothing in
        flight) takes the decode path (:mod:`velox_cache_core.decode`)."""
        return switch.fast_path(self)

    @property
    def stepped(self) -> list[tuple[int, int, Step]]:
        """The last call was a short chunk run as decode steps: the query rows ``[a, b)`` of
        each step and the step (empty otherwise)."""
        return self._stepped if self.hot is None else self.hot.stepped

    @stepped.setter
    def stepped(self, value: list[tuple[int, int, Step]]) -> None:
        if self.hot is not None:
            self.hot.stepped = value
        else:
            self._stepped = value

    # -- reading ---------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        """True absolute position of the next token (tokens seen, not tokens kept)."""
        hot = self.hot
        if hot is not None:
            return hot.offset + hot.in_flight
        pending = self._pending  # a call waiting for its queries, or a deferred step, counts
        waiting = int(pending.keys.shape[2]) if isinstance(pending, Waiting) else 0
        return int(self._state.offset) + waiting + isinstance(pending, Deferred)

    @property
    def quiet(self) -> bool:
        """No call in flight, no phase and no shared step sums: the state may be packed with
        other rows' (``velox_cache_core.batch``)."""
        return self.pending is None and self.phase is None and self.mode is not Mode.STEP_SUMS

    def arrays(self) -> list[mx.array]:
        """The arrays the layer's rows are held in now (the decode path's store while it
        decodes, which this leaves as it is; else the state's slots), to evaluate them."""
        if self.hot is not None:
            return self.hot.arrays()
        slots = self._state.slots
        return [] if slots is None else slots.arrays()

    def empty(self) -> bool:
        pending = isinstance(self.pending, (Waiting, Deferred))
        return self.state.slots is None and not pending

    def view(self) -> Any:
        """The state to read stats from: a call pending locally is settled first; a decode
        step waiting for the group's sums reads as the state before it (no collective)."""
        if isinstance(self.pending, Deferred):
            return self.pending.laid.state
        self.settle()
        return self.state

    # -- 1. lay out a call -----------------------------------------------------------------------
    def lay_out(self, keys: mx.array, values: mx.array) -> tuple[rows.Rows, rows.Rows]:
        """``[B, H_kv, L, D]`` rotated keys/values in; ``retained + new`` out (one token written
        over an evicted slot: the same rows in slot order), quantized rows
        (:class:`~velox_cache_core.store.token_rows.QRows`) when the layer has a ``quant``."""
        L = int(keys.shape[2])
        if self.hot is not None:  # decoding: the decode path's rows (velox_cache_core.decode)
            fetched = switch.lay_out_hot(self, keys, values)
            if fetched is not None:
                return fetched
        if self.stepped:
            self.stepped = []
        if L <= in_flight.STEPPED_CHUNK and switch.may_go_fast(self):
            self.last = None
            if switch.warm(self, L):
                fetched = switch.lay_out_hot(self, keys, values)
                if fetched is not None:
                    return fetched
        if self.phase is not None:
            self.fetched = self.phase.lay_out(self.state, self.policy.name, keys, values)
            return self.fetched
        keys, values = self.stored(keys, values)
        self.settle()
        self.last = None
        if L == 1:
            self._cut_globally("first_token")
        if self._waits(L):
            self.fetched = self._wait(keys, values)
            return self.fetched
        step = self._feed(self.state, keys=keys, values=values)
        self.pending = Decided(step, L)
        self.state = step.state
        self.fetched = (step.keys, step.values)
        return self.fetched

    def stored(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """A call's keys and values as the store holds them: quantized with :attr:`quant`
        (validated first, so that a bad call changes nothing), else unchanged."""
        if self.demote is not None:  # the tier quantizes the value rows it demotes
            self.demote.check_width(int(values.shape[3]))
        if self.quant is None or isinstance(keys, rows.QUANTIZED):
            return keys, values
        check_fits(None, keys, values)
        self.quant.check_width(int(keys.shape[3]), "the keys' head_dim")
        self.quant.check_width(int(values.shape[3]), "the values' width")
        return self.quant.quantize_keys(keys), self.quant.quantize(values)

    # a call waiting for its queries (velox_cache_core.waiting)
    _waits = waiting.waits
    _wait = waiting.wait

    # -- 2. settle with the queries ------------------------------------------------------------
    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """``[B, H_q, L, D]``: the call's queries over its candidates, the policy's mask."""
        hot = self.hot
        if hot is not None:  # decoding (velox_cache_core.decode)
            if hot.chunk is not None:
                return switch.attend_chunk(self, queries, scale, sinks)
            out = hot.attend(queries, scale, sinks)
            if out is not None:
                return out
        if self.phase is not None:
            return self.phase.attend(self.state, self.policy, queries, scale, sinks)
        pending, self.pending = self.pending, None
        if isinstance(pending, Waiting):
            return self._decide_waiting(pending, queries, scale, sinks)
        if isinstance(pending, Decided):
            self.state = self._after_call(pending.step.state, int(queries.shape[2]))
            self.last = pending.step
            return attend_step(queries, pending.step, scale, sinks)
        self.pending = pending
        if self.last is not None and self.demote is not None:  # ... with a tier
            return demoted.attend(queries, self.last, self.shared_tier, scale, sinks)[0]
        if self.last is not None:  # a layer sharing this one's keys and values
            return attend_step(queries, replace(self.last, probs=None), scale, sinks)
        if self.stepped:  # a short chunk run as steps: each query row over its own step
            outs = [
                attend_step(queries[:, :, a:b], replace(step, probs=None), scale, sinks)
                for a, b, step in self.stepped
            ]
            return mx.concatenate(outs, axis=2)
        raise RuntimeError("attend() called before update_and_fetch()")

    # attention over the model's own derived rows (velox_cache_core.without_queries)
    attend_rows = without_queries.attend_rows

    _decide_waiting = waiting.decide

    # -- 3. settle with the group's sums, or without the queries -------------------------------
    # a deferred decode step decided with the group's sums (velox_cache_core.step_sums)
    finish = step_sums.finish

    def settle(self) -> None:
        """Settle whatever is pending: a deferred step's sums are sent now (a collective:
        every rank reaches this point alike); a call the queries never reached is decided
        without them (signal ``key`` stands in for ``query``, with a warning)."""
        if isinstance(self.pending, Deferred):
            assert self.sums is not None
            self.sums.flush()
        pending = self.pending
        if pending is not None:
            assert not isinstance(pending, Deferred)  # the flush decided it
            without_queries.settle(self, pending)

    def keys_and_values(self) -> tuple[rows.Rows, rows.Rows]:
        """What the last call attended over (``retained + new``; the retained rows between
        calls), for layers that share this layer's keys and values."""
        if self.fetched is not None:
            return self.fetched
        self.settle()
        if self.state.slots is None:
            raise ValueError(f"the {self.policy.name} cache holds no keys yet")
        live = self.state.slots.compact()
        return live.keys, live.values

    # -- the prompt's end, trims, restores ---------------------------------------------------------
    def _feed(
        self,
        state: Any,
        *,
        keys: rows.Rows,
        values: rows.Rows,
        queries: mx.array | None = None,
        scale: float | None = None,
    ) -> Step:
        """One core update, recorded in the undo log (its layer-wide decisions summed over
        the layer's group)."""
        with summing_over(self.group):
            step = self.policy.update(
                state,
                keys=keys,
                values=values,
                queries=queries,
                scale=scale,
                check_finite=False,
                log=self.log,
            )
        self.log = step.log
        return step

    def _after_call(self, state: Any, length: int) -> Any:
        """Once a call's attention is built: the first single-token call ends the prompt
        (mlx-lm feeds the prompt's last token alone before decoding)."""
        if length == 1 and self.policy.prompt_end is not None:
            return self._end_prompt(state)
        return state

    _cut_globally = model_shares.cut_globally

    # between calls: the prompt's end, cuts, pins, trims, restores
    # (velox_cache_core.between_calls)
    take_cut = between_calls.take_cut
    _end_prompt = between_calls.end_prompt_now
    release = between_calls.release
    end_prompt = between_calls.end_prompt
    pin = between_calls.pin
    trimmable_tokens = property(between_calls.trimmable_tokens)
    trim = between_calls.trim
    restore = between_calls.restore
    tie = between_calls.tie

    # -- the model-driven phase: velox_cache_core.phase's functions ------------------------------
    compressor = property(phase.layer_compressor)
    start_phase = phase.start_phase
    score_chunk = phase.score_chunk
    phase_scores = phase.phase_scores
    finish_phase = phase.finish_phase
    abort_phase = phase.abort_phase
