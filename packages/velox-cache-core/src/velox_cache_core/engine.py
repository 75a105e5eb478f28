"""The one update path every policy goes through: validate, lay out candidates, decide, advance.

A call feeds ``L`` new tokens. Candidates are ``retained + new``: a single token is written
into the slot freed by the last eviction (in place), a chunk is appended after the live rows.
The policy's rule (``Policy.rule``) only says which candidates survive and, for a chunk, which
each query may see; everything else happens here once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from velox_cache_core.declarations import PolicyState, Traits
from velox_cache_core.lanes import LaneRule, Lanes, attend_weights, rows_at, victims
from velox_cache_core.lanes import write as write_row
from velox_cache_core.masks import chunk_causal, expand_heads
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import LaneStep, UndoLog, record, record_lanes
from velox_cache_core.validation import (
    check_fits,
    check_int,
    check_queries,
    check_scale,
    require_finite,
)

S = TypeVar("S", bound=PolicyState)


@dataclass(frozen=True)
class Step:
    """What one call's queries attend over, and the state after the call's evictions.

    keys, values: ``[B, H_kv, n, D]``; mask: ``None`` (all visible, only for ``L <= 1``) or bool
    ``[B, H, L, n]`` with ``H`` = 1 (same for all heads), ``H_q`` (per query head) or ``H_kv``
    (per KV head, no queries given: repeat each row over its query group).
    """

    keys: rows.Rows
    values: rows.Rows
    mask: mx.array | None
    state: Any
    log: UndoLog | None = None  # the undo log after the call, when one was given
    # float32 [B, H_q, 1, n]: the decode query's attention weights over ``keys`` when the rule
    # computed exactly them (signal query), so the caller can attend without computing them again
    probs: mx.array | None = None
    # rows an adaptive allocation kept (velox_cache_core.lanes), attended with ``keys``/``values``
    # (which then hold only the rows after the cut): every call's queries see all of them
    lanes: Lanes | None = None
    # [B, H_q, L, D_v]: the call's attention output, when the decision computed it (a step over
    # lanes that evict, velox_cache_core.lanes), so the caller does not attend again
    out: mx.array | None = None
    # int32 [B, H_kv, n]: the positions of ``keys`` (the general engine's steps; a demoted
    # tier scores the rows a call evicts by them, velox_cache_core.demoted)
    positions: mx.array | None = None


@dataclass(frozen=True)
class Call:
    """One validated update call. keys/values ``[B, H_kv, L, D]`` (full precision, or
    quantized as the store is), queries ``[B, H_q, L, D]``."""

    keys: rows.Rows
    values: rows.Rows
    queries: mx.array | None
    scale: float
    start: int  # absolute position of the first new token
    # int32 [B]: each row's own position of the new token, for a decode step of rows at
    # different positions (packed rows, velox_cache_core.batch); ``start`` is then moot
    row_start: mx.array | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, L, D = self.keys.shape
        return B, H, L, D

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def probe(self, signal: str) -> mx.array:
        """``[B, H_p, L, D]``: the true queries (signal ``query``) or the new keys (``key``,
        as stored: dequantized when the store is quantized)."""
        if signal == "query":
            assert self.queries is not None
            return self.queries
        return rows.dense(self.keys)

    def positions(self) -> mx.array:
        """int32 ``[L]`` positions of the new tokens (``[B, 1, L]`` with per-row starts)."""
        steps = mx.arange(self.length, dtype=mx.int32)
        if self.row_start is not None:
            return self.row_start[:, None, None] + steps
        return steps + self.start

    def newest(self) -> int | mx.array:
        """The position of the last new token (int32 ``[B, 1, 1]`` with per-row starts)."""
        if self.row_start is not None:
            return self.row_start[:, None, None] + (self.length - 1)
        return self.start + self.length - 1


@dataclass(frozen=True)
class Decision:
    """A rule's verdict on one call's candidates.

    kept: the surviving slots (the candidates themselves when nothing goes).
    mask: for a chunk, bool ``[B?, G, L, n]`` or ``[L, n]`` visibility of candidate ``j`` to
    query ``i`` (``G`` = 1 or one group per KV head); ``None`` means plain causal.
    changes: new values of the policy's own running fields.
    probs: the query's attention weights over the candidates, when the rule computed them
    (a decode step scored with the true query): float32 ``[B, H_q, 1, n]``.
    """

    kept: KVSlots
    mask: mx.array | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    probs: mx.array | None = None


class Policy(Protocol):
    """What the engine reads of a policy (``velox_cache_core.policy.Policy`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def state_type(self) -> type[PolicyState]: ...
    @property
    def rule(self) -> Callable[[Any, Call, KVSlots, KVSlots], Decision]: ...
    @property
    def evict_before(self) -> Callable[[Any, KVSlots, Call], KVSlots] | None: ...
    @property
    def grows_after_prompt_end(self) -> bool: ...
    @property
    def packs_rows(self) -> bool: ...
    @property
    def traits(self) -> Traits: ...
    @property
    def lane_rule(self) -> LaneRule | None: ...


def open_call(
    policy: Policy,
    state: PolicyState,
    keys: Any,
    values: Any,
    queries: Any,
    scale: Any,
    *,
    check_finite: bool,
) -> tuple[KVSlots, Call]:
    """Validate one update call of ``policy`` against ``state``; nothing is computed or
    changed on error.

    Queries are required when the state scores with signal ``query`` (a policy without a
    signal, like StreamingLLM, only validates them if given).
    """
    state_type = policy.state_type
    if not isinstance(state, state_type):
        raise TypeError(f"state must be a {state_type.__name__}, got {type(state).__name__}")
    signal = policy.traits.signal(state)
    slots = state.slots
    check_fits(slots, keys, values)
    if queries is not None:
        check_queries(queries, keys)
    elif signal == "query":
        if "signal" in state.settings:
            raise ValueError("queries are required when signal='query' (or use signal='key')")
        raise ValueError(f"queries are required: a {state_type.__name__} scores by them")
    scale = check_scale(scale, keys.shape[3])
    if check_finite:
        require_finite(keys=keys, values=values, queries=queries)
    if slots is None:
        slots = KVSlots.empty_like(keys, values)
    return slots, Call(keys, values, queries, scale, state.offset)


GROW = 64  # rows a growing store sets aside at a time for the single tokens that follow


def layout(slots: KVSlots, call: Call, limit: int | None = None) -> KVSlots:
    """``retained + new``: one token into the dead slot if there is one, else appended (a
    chunk always after the live rows, so the causal mask aligns bottom-right).

    A single appended token goes into the store's reserved rows, and a store that has to be
    copied for it sets aside up to :data:`GROW` more (never past ``limit`` slots: a policy
    whose decode steps hold at most ``budget + 1`` candidates reserves no row it cannot use).
    """
    if call.length == 1 and slots.free is not None:
        position = call.start if call.row_start is None else call.row_start
        return slots.write_free(call.keys, call.values, position)
    reserve = 0
    if call.length == 1:
        after = slots.n_slots + 1
        reserve = GROW if limit is None else max(0, min(GROW, limit - after))
    return slots.append(call.keys, call.values, call.positions(), reserve=reserve)


def slot_limit(policy: Policy, state: Any) -> int | None:
    """The most slots ``policy``'s decode steps lay out: ``budget + 1`` for a policy that
    evicts every decode step down to its budget, ``None`` for one that keeps every decoded
    token (SnapKV and KVzip after the prompt) or has no budget."""
    budget = policy.traits.budget(state)
    if policy.grows_after_prompt_end or budget is None:
        return None
    return budget + 1


def advance(state: S, slots: KVSlots, call: Call, **changes: Any) -> S:
    """The state after ``call``: new slots, offset and token count, plus policy fields."""
    B, H, L, _ = call.shape
    return replace(
        state,
        slots=slots,
        offset=call.start + L,
        tokens_seen=state.tokens_seen + B * H * L,
        **changes,
    )


def _full_mask(mask: mx.array | None, call: Call, n: int, scope: str) -> mx.array | None:
    """The rule's chunk mask (or the causal one) as ``[B, H, L, n]``: ``H`` = 1 for a
    layer-wide decision, else one per query head (per KV head when no queries were given)."""
    B, H_kv, L, _ = call.shape
    if L == 1:
        return mask
    if mask is None:
        mask = chunk_causal(n - L, L)
    heads = 1
    if scope != "layer":
        heads = H_kv if call.queries is None else call.queries.shape[1]
    return expand_heads(mask, B, heads)


@dataclass(frozen=True)
class Laid:
    """A call laid out over its candidates and not decided yet (:func:`prepare`).

    before: the slots the call found; slots: after the policy's ``evict_before``;
    candidates: ``retained + new`` (what the call's queries attend over).
    """

    state: Any
    call: Call
    before: KVSlots
    slots: KVSlots
    candidates: KVSlots
    # the state was cut into lanes by this call (an adaptive allocation's prompt end): the
    # cut cannot be undone, so the call clears the undo log
    cut: bool = False


def prepare(
    policy: Policy,
    state: Any,
    keys: Any,
    values: Any,
    queries: Any = None,
    scale: Any = None,
    *,
    check_finite: bool = True,
) -> Laid:
    """Validate one call of ``L >= 1`` tokens and lay out its candidates (:func:`update`'s
    first half; :func:`decide` is the second). Nothing is computed or changed on error."""
    slots, call = open_call(policy, state, keys, values, queries, scale, check_finite=check_finite)
    if call.length == 0:
        raise ValueError("prepare needs at least one new token (L >= 1); update takes L = 0")
    return _lay_out(policy, state, slots, call)


def _row_start(policy: Policy, call: Call, row_start: Sequence[int]) -> mx.array:
    """Validated per-row positions of a packed decode step, as int32 ``[B]``."""
    if not policy.packs_rows:
        raise ValueError(f"row_start: policy {policy.name!r} does not decide packed rows")
    if call.length != 1:
        raise ValueError(f"row_start needs one new token per row (L = 1), got L = {call.length}")
    starts = list(row_start)
    B = call.shape[0]
    if len(starts) != B:
        raise ValueError(f"row_start must be {B} ints (one per row), got {starts!r}")
    for b, p in enumerate(starts):
        check_int(f"row_start[{b}]", p, minimum=0)
    return mx.array(starts, dtype=mx.int32)


def _evicts_on_lanes(state: Any) -> bool:
    lanes = state.lanes
    return lanes is not None and lanes.free is not None


def _lay_out(policy: Policy, state: Any, slots: KVSlots, call: Call) -> Laid:
    rule = policy.lane_rule
    was_cut = False
    if rule is not None and state.lanes is None and call.length == 1:
        cut = rule.cut(state, call)  # a held prompt shared out at its end (adaptive allocation)
        if cut is not state:
            state, slots = cut, cut.slots
            was_cut = cut.lanes is not None
    if _evicts_on_lanes(state):  # nothing to lay out: the token goes into a head's dead row
        return Laid(state, call, slots, slots, slots, cut=was_cut)
    before = slots
    if call.length == 1 and policy.evict_before is not None:
        slots = policy.evict_before(state, slots, call)
    return Laid(state, call, before, slots, layout(slots, call, slot_limit(policy, state)))


def decide(policy: Policy, laid: Laid, log: UndoLog | None = None) -> Step:
    """The policy's decision on a laid-out call: what its queries attend over and the state
    after (recorded in ``log`` when given; see :func:`update`). Deciding the same ``laid``
    twice builds two decisions over the same candidates: the layout is not repeated."""
    state, call, candidates = laid.state, laid.call, laid.candidates
    if _evicts_on_lanes(state):
        return _decide_on_lanes(policy, laid, log)
    decision = policy.rule(state, call, laid.slots, candidates)
    mask = _full_mask(decision.mask, call, candidates.n_slots, policy.traits.scope(state))
    after = advance(state, decision.kept, call, **decision.changes)
    values = candidates.values
    if log is not None:
        entry = record(
            state,
            before=laid.before,
            laid_out_from=laid.slots,
            candidates=candidates,
            kept=decision.kept,
            keys=call.keys,
            values=call.values,
            queries=call.queries,
            scale=call.scale,
        )
        log = log.push(entry)
        # Evaluate the entry's rows with this call's attention (which reads the values), so they
        # hold no lazy reference to slots the next call overwrites in place.
        values = rows.tie(values, [*entry.arrays(), *log.compacted()])
    return Step(
        candidates.keys, values, mask, after, log, decision.probs, state.lanes,
        positions=candidates.positions,
    )  # fmt: skip


def _lane_token(
    rule: LaneRule, state: Any, call: Call, tail: KVSlots, lanes: Lanes, i: int
) -> tuple[Lanes, mx.array | None]:
    """Token ``i`` of ``call`` over ``lanes``: written into each head's dead row, attended,
    and each head's lowest row made the next dead row. Returns the lanes after it and its
    attention output (``None`` without queries)."""
    B, H = call.shape[:2]
    assert lanes.free is not None
    at = call.start + i if call.row_start is None else call.row_start + i
    lanes = write_row(lanes, call.keys[:, :, i : i + 1], call.values[:, :, i : i + 1], at)
    q = None if call.queries is None else call.queries[:, :, i : i + 1]
    probe = rule.probe(state)
    out = weights = None
    if probe == "query":
        assert q is not None
        out, weights = attend_weights(q, lanes, tail.keys, tail.values, None, call.scale)
    else:
        if probe == "key":
            key = rows.dense(call.keys[:, :, i : i + 1])
            weights = attend_weights(key, lanes, tail.keys, tail.values, None, call.scale)[1]
        if q is not None:
            out = attend_weights(q, lanes, tail.keys, tail.values, None, call.scale)[0]
    evict_by, running = rule.score(state, lanes, weights)
    newest = at if isinstance(at, int) else at.reshape(B, 1, 1)
    protected = rule.protect(state, lanes.positions, newest)
    return replace(lanes, free=victims(lanes, evict_by, protected, H), scores=running), out


def _decide_on_lanes(policy: Policy, laid: Laid, log: UndoLog | None) -> Step:
    """A call over lanes whose heads keep different row counts and evict at every step
    (:mod:`velox_cache_core.lanes`): token by token, the token is written into each head's
    dead row, attends over the head's rows, and the policy's lowest-scored row of each head
    becomes the dead row. A chunk runs token by token (each sees the rows the previous ones
    left: sequential prefill). The undo log cannot follow lanes: it is cleared."""
    rule = policy.lane_rule
    assert rule is not None
    state, call, tail = laid.state, laid.call, laid.slots
    L = call.length
    if L > 1 and call.queries is None:
        raise ValueError(
            f"a chunk over a {policy.name} cache with per-head shares (allocation head or "
            "global) needs the queries (the attention hook)"
        )
    if rule.observe is not None:
        state = replace(state, **rule.observe(state, call))
    lanes = state.lanes
    outs: list[mx.array | None] = []
    steps: list[LaneStep] = []
    for i in range(L):
        free, scores = lanes.free, lanes.scores
        lanes, out = _lane_token(rule, state, call, tail, lanes, i)
        outs.append(out)
        if log is not None and not laid.cut:  # the rows the next token overwrites
            assert free is not None and lanes.free is not None
            steps.append(LaneStep(free, scores, rows_at(lanes, lanes.free)))
    after = advance(state, tail, call, lanes=lanes)
    done = [o for o in outs if o is not None]
    out = mx.concatenate(done, axis=2) if len(done) == L else None
    if log is not None:
        if laid.cut:
            log = log.cleared()
        else:
            inputs = (call.keys, call.values, call.queries, call.scale)
            entry = record_lanes(laid.state, call.start, L, steps, inputs)
            log = log.push(entry)
            if out is not None:  # read the victims with the output, before the next write
                out = mx.depends([out], [*entry.arrays(), *log.compacted()])[0]
    return Step(tail.keys, tail.values, None, after, log, None, lanes, out)


def update(
    policy: Policy,
    state: Any,
    keys: Any,
    values: Any,
    queries: Any = None,
    scale: Any = None,
    *,
    check_finite: bool = True,
    log: UndoLog | None = None,
    row_start: Sequence[int] | None = None,
) -> Step:
    """Append ``L`` new tokens, return what their queries attend over, and evict to budget.

    keys, values: ``[B, H_kv, L, D]`` already position-encoded; queries: ``[B, H_q, L, D]``,
    required for signal ``query``; scale: softmax scale (default ``1/sqrt(D)``).
    ``check_finite`` rejects NaN/inf input at the cost of one host sync per call.
    The input state is never modified; a failed call raises before anything is computed.
    With an undo ``log`` (:mod:`velox_cache_core.undo`), the call is recorded in the returned
    ``Step.log`` so that it can be trimmed exactly. Under tensor parallelism, call it within
    :func:`velox_cache_core.distributed.summing_over` (as :class:`~velox_cache_core.layer.Layer`
    does): its layer-wide decisions then span every rank's heads.
    ``row_start``: for one token per row (``L = 1``) of a policy that ``packs_rows``, each
    row's own position of it (rows of a batch packed into one state, see
    :mod:`velox_cache_core.batch`); the state's ``offset`` then only counts calls.
    """
    slots, call = open_call(policy, state, keys, values, queries, scale, check_finite=check_finite)
    if row_start is not None:
        call = replace(call, row_start=_row_start(policy, call, row_start))
    if call.length == 0:
        live = slots.compact()
        return Step(
            live.keys, live.values, None, advance(state, slots, call), log, None, state.lanes
        )
    return decide(policy, _lay_out(policy, state, slots, call), log)
