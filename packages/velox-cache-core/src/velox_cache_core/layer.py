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
import enum
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from velox_cache_core import fast_step as FS
from velox_cache_core import lanes as LN
from velox_cache_core import pins as PN
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.declarations import Compressor
from velox_cache_core.decode import Appending, Evicting, Hot
from velox_cache_core.distributed import Group, Recorder, Replay, StepSums, summing_over
from velox_cache_core.engine import Laid, Step, check_fits, decide, prepare
from velox_cache_core.masks import chunk_causal
from velox_cache_core.policy import Policy
from velox_cache_core.store import rows as R
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.store.token_rows import Quant
from velox_cache_core.undo import UndoLog
from velox_cache_core.validation import check_scale

# Queries per internal sub-chunk of a long sequential-mode chunk (mlx-lm prefills 2048 at once):
# sequential mode does not depend on how a chunk is split, and sub-chunks keep the scan and the
# attention on ``retained + SUBCHUNK`` keys, not ``retained + L``.
SUBCHUNK = 256

_warned_no_hook: set[str] = set()
_warned_rows: set[str] = set()


class Mode(enum.Enum):
    """Where a layer's decisions are taken (see the module docstring)."""

    AT_ONCE = "at_once"
    QUERIES = "queries"
    STEP_SUMS = "step_sums"


@dataclass(frozen=True)
class Waiting:
    """A call laid out and waiting for its queries. keys/values ``[B, H_kv, L, D]``."""

    keys: R.Rows
    values: R.Rows


# A chunk of at most this many tokens, at the budget on the decode path, runs as decode steps
# (velox_cache_core.decode: a speculative verify chunk).
STEPPED_CHUNK = 16


@dataclass(frozen=True)
class Decided:
    """A call decided at once; ``attend`` may still come for its masks and weights."""

    step: Step
    length: int


@dataclass(frozen=True)
class Deferred:
    """A decode step attended; its decision waits for the pass's layer-wide sums."""

    laid: Laid


@dataclass
class Phase:
    """A model-driven phase in progress: each pass chunk scores context rows ``chunk``; its
    keys and values (``recon``) are attended to but never stored."""

    scores: list[mx.array] = field(default_factory=list)
    chunk: tuple[int, int] | None = None
    recon: tuple[mx.array, mx.array] | None = None


Pending = Waiting | Decided | Deferred | None


class Layer:
    """One layer's cache: ``policy``, ``state`` (its frozen core state), ``log`` (undo log or
    ``None``), the ``mode`` and the call in flight (``pending``).

    ``group``: the tensor-parallel group layer-wide decisions sum over (``None``: one
    process); ``sums``/``index``: the model's :class:`StepSums` and this layer's index in it
    (mode ``STEP_SUMS``). ``quant``: store the rows quantized
    (:class:`~velox_cache_core.store.token_rows.Quant`): each call's keys and values are
    quantized as they arrive, so what the queries attend over and what the policy scores are
    the same quantized rows.
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
        self.sums: StepSums | None = None
        self.index = 0
        self.phase: Phase | None = None
        # what the last lay_out returned, and the step its attention used: a layer sharing
        # this one's keys and values (KV sharing) attends over them again
        self.fetched: tuple[R.Rows, R.Rows] | None = None
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
            self._cool()
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
    def connect(self, group: Any) -> None:
        """Decide layer-wide over ``group`` (an ``mx.distributed.Group``; ``None`` or a group
        of one rank: alone); leaves ``STEP_SUMS``."""
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
        self.settle()
        self.group = None if group is None or group.size() == 1 else group
        self.sums = None
        if self.mode is Mode.STEP_SUMS:
            self.mode = Mode.QUERIES

    def share_step_sums(self, sums: StepSums | None, index: int = 0) -> None:
        """Mode ``STEP_SUMS`` through ``sums`` (over this layer's group) as layer ``index``
        (``None``: back to ``QUERIES``)."""
        if sums is not None:
            if not isinstance(sums, StepSums):
                raise TypeError(f"sums must be a StepSums, got {type(sums).__name__}")
            if sums.group is not self.group:
                raise ValueError("sums must communicate over this cache's group")
            if not isinstance(index, int) or not 0 <= index < sums.layers:
                raise ValueError(f"layer must be an int in [0, {sums.layers}), got {index!r}")
        self.settle()
        self.sums, self.index = sums, index
        self.mode = Mode.QUERIES if sums is None else Mode.STEP_SUMS

    # -- the state, its undo log and the call in flight (built from the decode path's rows) ---
    @property
    def state(self) -> Any:
        """The policy's frozen state (the decode path's rows, frozen, when decoding)."""
        if self.hot is not None:
            self._cool()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        if self.hot is not None:
            self._cool()
        self._state = value

    @property
    def log(self) -> UndoLog | None:
        """The undo log (``None``: the layer keeps none)."""
        if self.hot is not None:
            self._cool()
        return self._log

    @log.setter
    def log(self, value: UndoLog | None) -> None:
        if self.hot is not None:
            self._cool()
        self._log = value

    @property
    def pending(self) -> Pending:
        """The call in flight, if any."""
        hot = self.hot
        if hot is not None and not hot.idle:
            self._cool()
        return self._pending

    @pending.setter
    def pending(self, value: Pending) -> None:
        if value is not None and self.hot is not None:
            self._cool()
        self._pending = value

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
        pending = self._pending
        if pending is None:  # between calls
            return int(self._state.offset)
        extra = 0
        if isinstance(pending, Waiting):
            extra = int(pending.keys.shape[2])
        elif isinstance(pending, Deferred):
            extra = 1
        return int(self.state.offset) + extra

    @property
    def quiet(self) -> bool:
        """No call in flight, no phase and no shared step sums: the state may be packed with
        other rows' (``velox_cache_core.batch``)."""
        return self.pending is None and self.phase is None and self.mode is not Mode.STEP_SUMS

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
    def lay_out(self, keys: mx.array, values: mx.array) -> tuple[R.Rows, R.Rows]:
        """``[B, H_kv, L, D]`` rotated keys/values in; ``retained + new`` out (one token written
        over an evicted slot: the same rows in slot order), quantized rows
        (:class:`~velox_cache_core.store.token_rows.QRows`) when the layer has a ``quant``."""
        L = int(keys.shape[2])
        if self.hot is not None:  # decoding: the decode path's rows (velox_cache_core.decode)
            fetched = self._lay_out_hot(keys, values)
            if fetched is not None:
                return fetched
        if self.stepped:
            self.stepped = []
        if L <= STEPPED_CHUNK and self._may_go_fast():
            self.last = None
            if self._warm(L):
                fetched = self._lay_out_hot(keys, values)
                if fetched is not None:
                    return fetched
        if self.phase is not None:
            return self._lay_out_phase(keys, values)
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

    def _lay_out_hot(self, keys: mx.array, values: mx.array) -> tuple[R.Rows, R.Rows] | None:
        """A decode token or a short chunk on the decode path; ``None`` (and the path left)
        when it does not take it."""
        hot = self.hot
        assert hot is not None
        L = keys.shape[2]
        if L == 1:
            fetched = hot.write(keys, values)
        else:
            fetched = hot.lay_out_chunk(keys, values) if L <= STEPPED_CHUNK else None
        if fetched is None:
            self._cool()
            return None
        self.fetched = fetched
        return fetched

    def _may_go_fast(self) -> bool:
        """The decode path is on, nothing is in flight, and this layer decides alone (no
        group, no shared sums), over full-precision rows."""
        return (
            FS.ENABLED
            and self._pending is None
            and self.phase is None
            and self.quant is None
            and self.mode is not Mode.STEP_SUMS
            and self.group is None
        )

    def _warm(self, length: int) -> bool:
        """Take the decode path (:class:`~velox_cache_core.decode.Hot`) from the state now
        when its next call of ``length`` tokens is one the path takes: a decode step of an
        eligible state (:func:`velox_cache_core.fast_step.eligible`) or, waiting for the true
        queries, a short chunk of them."""
        state, policy = self._state, self.policy
        if state.slots is None:
            return False
        if length == 1 and FS.appends(policy, state):  # SnapKV after its cut
            if policy.prompt_end is not None and policy.end_prompt(state) is not state:
                return False  # the prompt has not ended yet
            self.hot = Appending(state, self._log)
            return True
        if policy.prompt_end is not None:
            return False
        if length > 1 and self.mode is not Mode.QUERIES:
            return False
        key = FS.eligible(self.policy, state, queries_needed=self._waits_fast())
        if key is None:
            return False
        self.hot = Evicting(self.policy, state, self._log, key, self.mode is Mode.AT_ONCE)
        return True

    def _cool(self) -> None:
        """Leave the decode path: the rows become a frozen state again, the undo entries the
        log's, and a token or chunk still waiting for its queries a plain :class:`Waiting`."""
        hot = self.hot
        assert hot is not None
        self.hot = None
        state, log, waiting, decided = hot.cool()
        self._state, self._log = state, log
        if waiting is not None:
            self._pending = Waiting(*waiting)
        elif decided is not None:
            self._pending = Decided(decided, 1)
        if hot.shared is not None:
            self.last = Step(hot.shared[0], hot.shared[1], None, state)
        if hot.stepped:
            self.stepped = hot.stepped

    @property
    def fast_path(self) -> bool:
        """Whether this layer's next decode step (a token of the store's shape, nothing in
        flight) takes the decode path (:mod:`velox_cache_core.decode`)."""
        if self.hot is not None:
            return self.hot.steady
        if not FS.ENABLED or self.mode is Mode.STEP_SUMS or self.group is not None:
            return False
        if self.phase is not None or self.quant is not None:
            return False
        state = self.view()
        if FS.appends(self.policy, state):
            return True
        if self.policy.prompt_end is not None:
            return False
        return FS.eligible(self.policy, state, queries_needed=self._waits_fast()) is not None

    def _waits_fast(self) -> bool:
        """Whether a decode-path step waits for its queries: a query-signal decision, or, on
        the CPU with the hook's queries to come, a decision without them whose compiled kernel
        attends too (attend once: one kernel instead of the kernel plus the attention's ops)."""
        if self._waits(1):
            return True
        return self.mode is Mode.QUERIES and mx.default_device() == mx.cpu

    def _attend_chunk(
        self, hot: Evicting, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        """``[B, H_q, L, D]``: a short chunk's tokens written, decided and attended one at a
        time on the decode path; from a token whose step it does not take, the rest of the
        chunk goes through the general path (sequential prefill, the same meaning)."""
        assert hot.chunk is not None
        keys, values = hot.chunk
        outs, taken = hot.attend_chunk(queries, scale, sinks)
        L = int(keys.shape[2])
        if taken == L:
            return mx.concatenate(outs, axis=2)
        self._cool()
        stepped = self.stepped
        needs = self._waits(1)
        rest = slice(taken, L)
        step = self._feed(
            self.state,
            keys=keys[:, :, rest],
            values=values[:, :, rest],
            queries=queries[:, :, rest] if needs else None,
            scale=check_scale(scale, int(keys.shape[3])) if needs else None,
        )
        self.state = step.state
        self.stepped = [*stepped, (taken, L, step)]
        outs.append(attend_step(queries[:, :, rest], step, scale, sinks))
        return mx.concatenate(outs, axis=2)

    def stored(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """A call's keys and values as the store holds them: quantized with :attr:`quant`
        (validated first, so that a bad call changes nothing), else unchanged."""
        if self.quant is None or isinstance(keys, R.QUANTIZED):
            return keys, values
        check_fits(None, keys, values)
        self.quant.check_width(int(keys.shape[3]), "the keys' head_dim")
        self.quant.check_width(int(values.shape[3]), "the values' width")
        return self.quant.quantize_keys(keys), self.quant.quantize(values)

    def _waits(self, length: int) -> bool:
        """Whether a call waits for ``attend``: a chunk (which ``attend`` may split and mask
        per head) or a state scoring by the true queries, unless the mode decides at once."""
        if self.mode is Mode.AT_ONCE:
            return False
        return length > 1 or self.policy.traits.signal(self.state) == "query"

    def _wait(self, keys: R.Rows, values: R.Rows) -> tuple[R.Rows, R.Rows]:
        check_fits(self.state.slots, keys, values)
        self.pending = Waiting(keys, values)
        return self._with_new(keys, values)

    def _with_new(self, keys: R.Rows, values: R.Rows) -> tuple[R.Rows, R.Rows]:
        """``retained + new``: what :meth:`lay_out` returns for a call that waits for its
        queries (``keys``/``values`` already checked against the store)."""
        slots = self.state.slots
        if slots is None:
            return keys, values
        if keys.shape[2] == 1 and slots.free is not None:
            # Fewer ops than a compaction plus a concatenation, which the hook then ignores.
            laid_out = slots.write_free(keys, values, self.state.offset)
            return laid_out.keys, laid_out.values
        if slots.free is not None and all(
            isinstance(a, mx.array) for a in (slots.keys, slots.values, keys, values)
        ):  # a verify chunk at the budget: the same ops, one compiled call
            return FS.joined(slots.keys, slots.values, slots.positions, slots.free, keys, values)
        live = slots.compact()
        return R.concat([live.keys, keys], axis=2), R.concat([live.values, values], axis=2)

    # -- 2. settle with the queries ------------------------------------------------------------
    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """``[B, H_q, L, D]``: the call's queries over its candidates, the policy's mask."""
        hot = self.hot
        if hot is not None:  # decoding (velox_cache_core.decode)
            if hot.chunk is not None:
                return self._attend_chunk(hot, queries, scale, sinks)
            out = hot.attend(queries, scale, sinks)
            if out is not None:
                return out
        if self.phase is not None:
            return self._attend_phase(queries, scale, sinks)
        pending, self.pending = self.pending, None
        if isinstance(pending, Waiting):
            return self._decide_waiting(pending, queries, scale, sinks)
        if isinstance(pending, Decided):
            self.state = self._after_call(pending.step.state, int(queries.shape[2]))
            self.last = pending.step
            return attend_step(queries, pending.step, scale, sinks)
        self.pending = pending
        if self.last is not None:  # a layer sharing this one's keys and values
            return attend_step(queries, replace(self.last, probs=None), scale, sinks)
        if self.stepped:  # a short chunk run as steps: each query row over its own step
            outs = [
                attend_step(queries[:, :, a:b], replace(step, probs=None), scale, sinks)
                for a, b, step in self.stepped
            ]
            return mx.concatenate(outs, axis=2)
        raise RuntimeError("attend() called before update_and_fetch()")

    def attend_rows(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        scores: mx.array | None = None,
        sinks: mx.array | None = None,
    ) -> mx.array:
        """Attention of ``queries [B, H_q, L, D_q]`` over the model's own ``keys``/``values``
        ``[B, H, n, *]``, derived row by row from what :meth:`lay_out` returned (the same
        ``n`` rows in the same order, e.g. latent attention's up-projections), plus the
        model's additive ``scores`` ``[B?, H?, L, n]`` (latent attention's RoPE part). The
        call is decided with signal ``key`` (the policy's scoring cannot read these queries),
        with a warning once; the policy's mask hides what it evicted."""
        step = self._decide_for_rows()
        n = int(step.keys.shape[2])
        if keys.shape[2] != n or values.shape[2] != n:
            raise ValueError(
                f"{self.serves or 'the model'} attends over {keys.shape[2]} rows, but this "
                f"cache returned {n}: Velox cannot tell which rows it evicted there"
            )
        visible = step.mask
        if visible is not None and visible.shape[1] not in (1, queries.shape[1]):
            if keys.shape[1] != step.keys.shape[1]:
                raise ValueError(
                    f"{self.serves or 'the model'} regroups the cache's {step.keys.shape[1]} KV "
                    f"heads into {keys.shape[1]} before attention, and this "
                    f"{self.policy.name} cache evicts per head: use scope='layer'"
                )
            visible = mx.repeat(visible, queries.shape[1] // visible.shape[1], axis=1)
        mask = scores
        if visible is not None:
            floor = mx.array(mx.finfo(queries.dtype).min, queries.dtype)
            mask = mx.where(visible, 0.0 if mask is None else mask, floor)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks
        )

    def _decide_for_rows(self) -> Step:
        """Settle the call in flight for :meth:`attend_rows` (signal ``key`` for ``query``)."""
        pending, self.pending = self.pending, None
        if isinstance(pending, Decided):
            self.state = self._after_call(pending.step.state, pending.length)
            self.last = pending.step
            return pending.step
        if not isinstance(pending, Waiting):
            self.pending = pending
            if self.last is not None:  # a layer sharing this one's keys and values
                return self.last
            raise RuntimeError("attend() called before update_and_fetch()")
        state = self.state
        query = self.policy.traits.signal(state) == "query"
        if query:
            who = self.serves or self.policy.name
            self._refuse_without_queries(
                pending, f"{who} attends over keys, values or scores of its own, not the cache's"
            )
            if who not in _warned_rows:
                _warned_rows.add(who)
                warnings.warn(
                    f"{who} attends over keys, values or scores of its own, not the cache's: "
                    f"the {self.policy.name} cache scores with signal 'key' there.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            state = replace(state, signal="key")
        L = int(pending.keys.shape[2])
        step = self._feed(state, keys=pending.keys, values=pending.values)
        after = replace(step.state, signal="query") if query else step.state
        self.state = self._after_call(after, L)
        self.last = replace(step, state=self.state)
        return step

    def _decide_waiting(
        self, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        keys, values = pending.keys, pending.values
        L = int(keys.shape[2])
        if L > SUBCHUNK and self.policy.traits.prefill(self.state) == "sequential":
            return self._attend_subchunks(pending, queries, scale, sinks)
        if L == 1 and self.mode is Mode.STEP_SUMS:
            return self._attend_deferring(pending, queries, scale, sinks)
        step = self._feed(self.state, keys=keys, values=values, queries=queries, scale=scale)
        self.state = self._after_call(step.state, L)
        self.last = step
        return attend_step(queries, step, scale, sinks)

    def _attend_subchunks(
        self, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        outs = []
        L = int(pending.keys.shape[2])
        for s in range(0, L, SUBCHUNK):
            part = slice(s, s + SUBCHUNK)
            q = queries[:, :, part]
            step = self._feed(
                self.state,
                keys=pending.keys[:, :, part],
                values=pending.values[:, :, part],
                queries=q,
                scale=scale,
            )
            self.state = step.state
            outs.append(attend_step(q, step, scale, sinks))
        self.state = self._after_call(self.state, L)
        return mx.concatenate(outs, axis=2)

    def _attend_deferring(
        self, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        """Attend now; decide when the pass's last layer has arrived (:meth:`finish`)."""
        sums = self.sums
        assert sums is not None
        recorder = Recorder(self.group)
        laid = prepare(
            self.policy,
            self.state,
            keys=pending.keys,
            values=pending.values,
            queries=queries,
            scale=scale,
            check_finite=False,
        )
        with summing_over(recorder):
            step = decide(self.policy, laid, self.log)
        if recorder.sums:  # the decision waits for the sums; the attention does not
            self.pending = Deferred(laid)
            sums.defer(recorder.sums, self.finish)
            step = replace(step, values=laid.candidates.values)
        else:  # nothing was summed over the group: this is the decision
            self.log = step.log
            self.state = self._after_call(step.state, 1)
        out = attend_step(queries, step, scale, sinks)
        tied = sums.arrive(self.index)
        return mx.depends([out], tied)[0] if tied else out

    # -- 3. settle with the group's sums, or without the queries -------------------------------
    def finish(self, replay: Replay) -> list[mx.array]:
        """Decide the deferred step with the group's sums; its new arrays, to evaluate with
        the forward pass (the log's rows then hold no lazy read of slots written in place)."""
        pending, self.pending = self.pending, None
        assert isinstance(pending, Deferred)
        with summing_over(replay):
            step = decide(self.policy, pending.laid, self.log)
        self.log = step.log
        self.state = self._after_call(step.state, 1)
        tied = self.state.slots.arrays()
        if step.log is not None and step.log.entries:
            tied += step.log.entries[-1].arrays()
        return tied

    def settle(self) -> None:
        """Settle whatever is pending: a deferred step's sums are sent now (a collective:
        every rank reaches this point alike); a call the queries never reached is decided
        without them (signal ``key`` stands in for ``query``, with a warning)."""
        if isinstance(self.pending, Deferred):
            assert self.sums is not None
            self.sums.flush()
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        if self.must_attend:
            self.pending = pending
            raise RuntimeError(
                f"{self.serves or 'the model'} uses this {self.policy.name} cache outside its "
                "attention call (the attention hook never saw the call), so Velox cannot "
                "evict it consistently with the model's other uses of it; serve this model "
                "with method='full'"
            )
        if self.policy.traits.hides_rows(self.state) or self.state.lanes is not None:
            # The model attended by itself: over rows only the hook's masks hide, or without
            # the rows an adaptive allocation keeps per head (lanes), which only it reads.
            raise RuntimeError(
                f"this {self.policy.name} cache holds rows that only the attention hook "
                "attends correctly (pad slots or per-head lanes), and the last call ran "
                "without it: install it (velox_mlx_lm.install_attention_hook(model); "
                "KVCacheBuilder.for_model does)"
            )
        if isinstance(pending, Decided):  # attention never came back
            self.state = self._after_call(self.state, pending.length)
            return
        assert isinstance(pending, Waiting)
        self._decide_unseen(pending)

    def _decide_unseen(self, pending: Waiting) -> None:
        L = int(pending.keys.shape[2])
        if self.policy.traits.signal(self.state) != "query":  # decided as the hook would have
            step = self._feed(self.state, keys=pending.keys, values=pending.values)
            self.state = self._after_call(step.state, L)
            return
        self._refuse_without_queries(
            pending,
            f"a call of {self.serves or 'this layer'} came without them: the attention hook "
            "never saw it "
            "(KVCacheBuilder.for_model installs it; it cannot reach a model that computes "
            "attention by hand)",
        )
        if self.policy.name not in _warned_no_hook:
            _warned_no_hook.add(self.policy.name)
            warnings.warn(
                f"a {self.policy.name} cache was used without the attention hook "
                "(KVCacheBuilder.for_model installs it): eviction fell back to signal 'key'.",
                RuntimeWarning,
                stacklevel=4,
            )
        keyed = replace(self.state, signal="key")
        step = self._feed(keyed, keys=pending.keys, values=pending.values)
        self.state = self._after_call(replace(step.state, signal="query"), L)

    def _refuse_without_queries(self, pending: Waiting, why: str) -> None:
        """A policy scoring by the true queries without a ``signal`` setting has no key
        stand-in (Expected Attention's statistics are the queries'): ``ValueError`` saying
        ``why`` the queries are missing; the call stays pending."""
        if "signal" in self.state.settings:
            return
        self.pending = pending
        raise ValueError(
            f"{self.policy.name} needs the true queries (it has no signal='key' stand-in), "
            f"but {why}; serve this model with another method"
        )

    def keys_and_values(self) -> tuple[R.Rows, R.Rows]:
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
        keys: R.Rows,
        values: R.Rows,
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

    def _cut_globally(self, when: str) -> bool:
        """At ``when``, a state awaiting a model-wide cut (``allocation="global"``) takes part
        in it: ``"first_token"`` cuts every linked layer now, ``"prompt_end"`` arrives (the
        last layer to arrive cuts them all). Returns whether it did."""
        rule = self.policy.global_rule
        state = self.state
        if rule is None or rule.when != when or state.allocation != "global":
            return False
        if not rule.pending(state):
            return False
        if self.shares is None:
            raise ValueError(LN.UNLINKED.format(name=self.policy.name))
        if when == "first_token":
            self.shares.cut_all()
        else:
            self.shares.arrive(self)
        return True

    def take_cut(self, state: Any) -> None:
        """Take ``state``, this layer cut by a model-wide allocation or a model-driven phase
        (the cut cannot be undone: the log is cleared)."""
        self.state = state
        self._forget_call()
        if self.log is not None:
            self.log = self.log.cleared()

    def _end_prompt(self, state: Any) -> Any:
        self.state = state
        if self._cut_globally("prompt_end"):
            return self.state
        ended = self.policy.end_prompt(state)
        if ended is not state and self.log is not None:  # the cut cannot be undone
            self.log = self.log.cleared()
        return ended

    def _forget_call(self) -> None:
        """Drop what the last call attended over: after a cut outside a forward pass it is
        the whole uncut context, which nothing reads any more (a layer sharing these keys
        reads them within the same pass)."""
        self.fetched = None
        self.last = None

    def end_prompt(self) -> None:
        """End the prompt now (a no-op for policies without a prompt-end step)."""
        self.settle()
        self.state = self._end_prompt(self.state)
        self._forget_call()

    def pin(self, start: int, stop: int) -> None:
        """Never evict tokens ``[start, stop)`` (token indices, 0 = the sequence's first; in
        every row of a batch): seen ones must all still be kept, future ones are kept as they
        come. They count in the budget; ``ValueError`` and no change when they do not fit
        (:mod:`velox_cache_core.pins`)."""
        self.settle()
        self.state = PN.pin(self.policy, self.state, start, stop)

    def trim(self, n: int) -> None:
        """Forget the last ``n`` tokens exactly; ``ValueError`` and no change when the undo
        log does not reach back ``n`` tokens (or there is none). Pinned spans stay pinned."""
        self.settle()
        if self.log is None:
            raise ValueError(
                f"cannot trim a {self.policy.name} cache: it keeps no undo log (trim_window=0)"
            )
        if self.state.holds_prompt:
            raise ValueError(
                f"cannot trim a {self.policy.name} cache that still holds its prompt for the "
                f"allocation={self.state.allocation!r} cut, which comes with the first "
                "single-token call: speculative decoding (mlx-lm's verifies drafts in chunks) "
                "never makes one, so the cache would grow without bound; use "
                "allocation='uniform' with a draft model"
            )
        with summing_over(self.group):
            self.state, self.log = self.policy.trim(self.state, self.log, n)

    def restore(self, state: Any, log: UndoLog | None) -> None:
        """Take ``state`` and ``log`` as this layer's (a row unpacked from a batch, a loaded
        prompt cache); nothing stays pending."""
        self.state, self.log = state, log
        self.pending = None
        self.phase = None
        self.fetched = self.last = None
        self.stepped = []

    def tie(self, value: mx.array) -> None:
        """Tie ``value`` to the stored keys without changing them (pipeline-parallel sends)."""
        self.settle()
        slots = self.state.slots
        if slots is None:
            return
        tied = R.tie(slots.keys, [value])
        self.state = replace(self.state, slots=replace(slots, keys=tied))

    # -- the model-driven phase -----------------------------------------------------------------
    @property
    def compressor(self) -> Compressor:
        compressor = self.policy.compressor
        if compressor is None:
            raise ValueError(f"policy {self.policy.name!r} declares no model-driven phase")
        return compressor

    def start_phase(self) -> None:
        """Enter the phase (the context must be whole: not compressed yet)."""
        compressor = self.compressor
        self.settle()
        compressor.check(self.state)  # raises on a compressed or empty state
        self.phase = Phase()

    def score_chunk(self, start: int, end: int) -> None:
        """The next forward pass scores context rows ``start..end-1``."""
        if self.phase is None:
            raise RuntimeError("score_chunk() outside the scoring phase (call start_phase())")
        self.phase.chunk = (start, end)

    def phase_scores(self) -> mx.array:
        """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
        if self.phase is None or not self.phase.scores:
            raise ValueError("no chunk of the scoring pass was scored")
        return mx.concatenate(self.phase.scores, axis=-1)

    def finish_phase(self, budget: int | None = None, total: int | None = None) -> None:
        """Leave the phase: cut the context by every chunk's scores (to ``budget`` if given;
        ``total``: the layer's share of a model-wide row total)."""
        if self.phase is None:
            raise RuntimeError("finish_phase() outside the scoring phase")
        scores = self.phase_scores()
        state = self.policy.rebudget(self.state, budget)
        state = self.compressor.cut(state, scores, total)  # raises: unchanged
        self.phase = None
        self.take_cut(state)

    def abort_phase(self) -> None:
        """Leave the phase uncompressed (after an error in the pass)."""
        self.phase = None

    def _live(self) -> KVSlots:
        if self.state.slots is None:
            raise ValueError(f"the {self.policy.name} cache holds no context to score")
        return self.state.slots.compact()

    def _lay_out_phase(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        assert self.phase is not None
        live = self._live()
        check_fits(live, keys, values, stored=False)  # attended over, never stored
        self.phase.recon = (keys, values)
        # The scoring pass's own rows are not stored: they attend at full precision over the
        # (dequantized) context.
        self.fetched = (
            mx.concatenate([R.dense(live.keys), keys.astype(live.keys.dtype)], axis=2),
            mx.concatenate([R.dense(live.values), values.astype(live.values.dtype)], axis=2),
        )
        return self.fetched

    def _attend_phase(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        phase = self.phase
        assert phase is not None
        if phase.recon is None or phase.chunk is None:
            raise RuntimeError("attend() in the scoring phase needs score_chunk() and a call")
        (keys, values), phase.recon = phase.recon, None
        start, end = phase.chunk
        phase.scores.append(self.compressor.score(self.state, queries, keys, start, end, scale))
        live = self._live()
        dtype = live.keys.dtype
        all_keys = mx.concatenate([R.dense(live.keys), keys.astype(dtype)], axis=2)
        all_values = mx.concatenate([R.dense(live.values), values.astype(dtype)], axis=2)
        L = int(keys.shape[2])
        causal = None if L == 1 else chunk_causal(live.n_slots, L)[None, None]
        return mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=scale, mask=causal, sinks=sinks
        ).astype(queries.dtype)
