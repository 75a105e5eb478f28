"""The attention-weight eviction rule shared by TOVA, MorphKV and H2O.

Each step the probe rows (the new token's query or key, plus up to ``window - 1`` earlier ones
for MorphKV) attend over the candidates; their weights, averaged per decision group and fused
over rows, either decide directly (TOVA, MorphKV: memoryless) or are added to running scores
that decide (H2O: inertial). The lowest goes; sinks, pinned spans and, for H2O, a recent
window never do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_cache_core.declarations import PolicyState, Prefill, Signal, running
from velox_cache_core.distributed import decision_mean
from velox_cache_core.engine import Call, Decision
from velox_cache_core.history import History
from velox_cache_core.scoring import Scope, grouped_logits, masked_softmax, softmax
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.sequential import Rule, alive_mask, eviction_steps, fuse_rows, row_visibility
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_choice

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")
PREFILLS = ("sequential", "oneshot")


@dataclass(frozen=True, kw_only=True)
class RuleState(PolicyState):
    """What every state deciding by :func:`decide_by_weights` holds (TOVA, H2O, MorphKV): the
    rule's settings and the probe rows it keeps (MorphKV's last ``window - 1``; while an
    adaptive allocation holds the prompt, its last row; else ``None``)."""

    budget: int
    n_sink: int
    signal: Signal
    scope: Scope
    prefill: Prefill
    history: History | None = running()

    @property
    def rule(self) -> Rule:
        return Rule(self.budget, self.n_sink, self.signal, self.scope, self.prefill, pins=self.pins)


def rule_choices(
    signal: Any, scope: Any, prefill: Any, defaults: Mapping[str, str]
) -> dict[str, Any]:
    """``signal``, ``scope`` and ``prefill`` (``None``: the one ``defaults`` gives, if any)
    checked against their choices, as state fields."""
    given = {"signal": (signal, SIGNALS), "scope": (scope, SCOPES), "prefill": (prefill, PREFILLS)}
    return {
        name: check_choice(name, defaults.get(name) if value is None else value, options)
        for name, (value, options) in given.items()
    }


def extended(
    history: History | None, probes: mx.array, positions: mx.array, keep: int
) -> History | None:
    """``history`` (``None``: empty) with ``probes`` ``[B, H_p, L, D]`` at ``positions``
    ``[L]`` appended, its last ``keep`` rows kept (``None`` for ``keep=0``)."""
    past = history or History(probes[:, :, :0], positions[:0])
    return past.extend(probes, positions, keep)


def record_probes(state: Any, call: Call, candidates: KVSlots, keep: int) -> Decision:
    """Keep every candidate; remember the last ``keep`` probe rows (by the state's ``signal``)
    and the call's scale: a prompt held whole for a cut at its end (SnapKV, KVzip)."""
    history = extended(state.history, call.probe(state.signal), call.positions(), keep)
    return Decision(candidates, changes={"history": history, "scale": call.scale})


def protect_recent(state: Any, positions: mx.array, newest: Any) -> mx.array:
    """bool: a state's sinks, pinned spans and ``recent`` newest positions (``newest``: the
    newest one, int or int ``[B, 1, 1]``); H2O's and Expected Attention's ``protect``."""
    return sinks(positions, state.n_sink, state.pins) | (positions > newest - state.recent)


def _probe_logits(
    rule: Rule, call: Call, candidates: KVSlots, last: int = 0
) -> tuple[mx.array, mx.array]:
    """(logits ``[B, G, H_d, R, n]`` of the probe rows over the candidates, their positions
    ``[R]``): ``rule.history``'s rows, then the call's (the ``last`` ones only when given)."""
    rows, row_positions = call.probe(rule.signal), call.positions()
    if rule.history is not None:
        rows = mx.concatenate([rule.history.probes, rows], axis=2)
        row_positions = mx.concatenate([rule.history.positions, row_positions])
    if last:
        rows, row_positions = rows[:, :, -last:], row_positions[-last:]
    return grouped_logits(rows, candidates.keys, call.scale, rule.scope), row_positions


def _fused_weights(
    rule: Rule, logits: mx.array, positions: mx.array, row_positions: mx.array
) -> tuple[mx.array, mx.array]:
    """``[B, G, H_d, R, n]`` logits of probe rows at ``row_positions`` -> (fused ``[B, G, n]``
    weights, heads averaged by :func:`decision_mean`; per-row weights ``[B, G, H_d, R, n]``).
    Earlier rows (MorphKV) do not see the candidates that came after them."""
    if logits.shape[3] == 1:  # one row sees every candidate: plain softmax (TOVA exactly)
        row_weights = softmax(logits.astype(mx.float32))
        return decision_mean(row_weights, 2, rule.scope)[:, :, 0], row_weights
    visible = row_visibility(positions, row_positions)[:, :, None]
    row_weights = masked_softmax(logits, visible)
    return fuse_rows(decision_mean(row_weights, 2, rule.scope), rule.fusion), row_weights


def align_scores(scores: mx.array, slots: KVSlots, groups: int, new: int) -> mx.array:
    """Running scores ``[B, G, S]`` of ``slots``, laid out like the engine's candidates
    (``retained + new``; the new tokens start at 0)."""
    B = scores.shape[0]
    if new == 1 and slots.free is not None:  # the new token reuses the dead slot
        cols = mx.arange(scores.shape[-1])
        return mx.where(cols == slots.free[:, :groups, None], 0.0, scores)
    idx = slots.live_index()
    if idx is not None:
        scores = mx.take_along_axis(scores, idx[:, :groups], axis=-1)
    return mx.concatenate([scores, mx.zeros((B, groups, new), dtype=scores.dtype)], axis=-1)


def decide_by_weights(
    rule: Rule,
    call: Call,
    candidates: KVSlots,
    scores: mx.array | None = None,
) -> tuple[Decision, mx.array | None]:
    """Evict ``candidates`` down to ``rule.budget`` by the probe rows' attention weights.

    ``scores`` (``[B, G, n]`` aligned with the candidates, see :func:`align_scores`) switch the
    rule to accumulating weights; the updated scores of the kept slots are returned.
    Layer-wide weights are averaged by :func:`~velox_cache_core.distributed.decision_mean`:
    over every rank's heads under tensor parallelism, so every rank takes the same decision.
    One function per path: a decode step, a sequential chunk, a oneshot chunk.
    """
    if call.length == 1:
        return _decide_step(rule, call, candidates, scores)
    if candidates.n_slots <= rule.budget and scores is None:
        return Decision(candidates), scores
    if rule.prefill == "sequential":
        return _decide_sequential(rule, call, candidates, scores)
    return _decide_oneshot(rule, call, candidates, scores)


def _decide_step(
    rule: Rule,
    call: Call,
    candidates: KVSlots,
    scores: mx.array | None,
) -> tuple[Decision, mx.array | None]:
    """One token: evict the lowest weight (or accumulated score) when over budget."""
    n = candidates.n_slots
    evict = n > rule.budget
    if not evict and scores is None:
        return Decision(candidates), scores
    positions = candidates.positions[:, : rule.groups(call.shape[1])]
    logits, row_positions = _probe_logits(rule, call, candidates)
    weights, row_weights = _fused_weights(rule, logits, positions, row_positions)
    probs = None
    if rule.signal == "query":
        # The newest row is the model's own query, which sees every candidate: its softmax is
        # the attention itself, so the caller can attend from it ([B, H_q, 1, n]).
        last = row_weights[:, :, :, -1:]
        probs = last.reshape(last.shape[0], -1, 1, n)
    if scores is not None:
        scores = weights = scores + weights
    kept = candidates
    if evict:
        excluded = rule.protected(positions, call.newest())
        kept = candidates.with_free(lowest_weight(weights, positions, excluded))
    return Decision(kept, probs=probs), scores


def _keep(
    candidates: KVSlots, keep: mx.array, scores: mx.array | None
) -> tuple[KVSlots, mx.array | None]:
    """The candidates at indices ``keep`` ``[B, G, budget]``, with their running scores."""
    if scores is not None:
        scores = mx.take_along_axis(scores, keep, axis=-1)
    return candidates.take(keep), scores


def _decide_sequential(
    rule: Rule,
    call: Call,
    candidates: KVSlots,
    scores: mx.array | None,
) -> tuple[Decision, mx.array | None]:
    """A chunk decided token by token, as if fed one at a time (masks say who saw whom)."""
    L, n = call.length, candidates.n_slots
    positions = candidates.positions[:, : rule.groups(call.shape[1])]
    logits, row_positions = _probe_logits(rule, call, candidates)
    evict_step, scores = eviction_steps(
        logits, row_positions, positions, rule, start=call.start, length=L, scores=scores
    )
    mask = alive_mask(evict_step, positions, call.start, L)
    kept = candidates
    if n > rule.budget:
        cols = mx.arange(n)
        order = mx.argsort(mx.where(evict_step == L, cols, n + cols), axis=-1)
        kept, scores = _keep(candidates, order[..., : rule.budget], scores)
    return Decision(kept, mask), scores


def _decide_oneshot(
    rule: Rule,
    call: Call,
    candidates: KVSlots,
    scores: mx.array | None,
) -> tuple[Decision, mx.array | None]:
    """A chunk attended causally, then cut once by the last rows' (or accumulated) weights."""
    positions = candidates.positions[:, : rule.groups(call.shape[1])]
    if scores is not None:
        # Every chunk query attends causally; each adds its weights to the running sums.
        logits = grouped_logits(call.probe(rule.signal), candidates.keys, call.scale, rule.scope)
        visible = row_visibility(positions, call.positions())[:, :, None]
        weights = decision_mean(masked_softmax(logits, visible), 2, rule.scope).sum(2)
        scores = weights = scores + weights
    else:
        logits, row_positions = _probe_logits(rule, call, candidates, rule.window)
        weights = _fused_weights(rule, logits, positions, row_positions)[0]
    kept = candidates
    if candidates.n_slots > rule.budget:
        protected = rule.protected(positions, call.newest())
        keep = highest_weights(weights, positions, protected, rule.budget)
        kept, scores = _keep(candidates, keep, scores)
    return Decision(kept, None), scores
