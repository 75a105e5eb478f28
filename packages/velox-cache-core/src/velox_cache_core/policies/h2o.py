"""H2O: Heavy-Hitter Oracle (Zhang et al., 2023, https://arxiv.org/abs/2306.14048).

Every retained token accumulates the attention it receives from every query that sees it (the
prompt's too); the lowest running sum is evicted, except sinks and the ``recent`` newest
tokens. Inertial where TOVA is memoryless: the state carries the scores.

``allocation="head"`` (AdaKV; scope ``head``): the prompt is held whole while its sums
accumulate, then cut at its end (the first single-token call) into per-head shares by those
sums, each head keeping its sinks, its recent window and at least ``allocation_floor`` of the
uniform share (:mod:`velox_cache_core.lanes`); decode steps then evict within each head's share,
the sums carried on the lanes. ``global`` (scope ``head``) shares the model's ``budget`` rows
per head on average across every head of every layer by the same sums: the first single-token
call of any layer cuts them all (:class:`~velox_cache_core.model_shares.ModelShares`, linked by
``velox_mlx_lm``'s builder).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core import lanes as LN
from velox_cache_core.attention_rule import History, Rule, align_scores, decide_by_weights
from velox_cache_core.declarations import (
    PolicyState,
    Prefill,
    Scope,
    Signal,
    read_settings,
    running,
)
from velox_cache_core.engine import Call, Decision
from velox_cache_core.policies.tova import PREFILLS, SCOPES, SIGNALS
from velox_cache_core.policy import Policy
from velox_cache_core.selection import sinks
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks, check_choice, check_int


@dataclass(frozen=True, kw_only=True)
class H2OState(PolicyState):
    """H2O layer state. scores: float32 ``[B, G, S]`` running attention sums, slot-aligned
    (``G`` = 1 for scope ``layer``, ``H_kv`` for ``head``)."""

    budget: int
    n_sink: int
    recent: int
    signal: Signal
    scope: Scope
    prefill: Prefill
    allocation: str = "uniform"
    allocation_floor: float = LN.FLOOR
    scores: mx.array | None = running()
    # the last probe row while an adaptive allocation holds the prompt (a marker: None once
    # the prompt is cut, or always with the uniform allocation)
    history: History | None = running()

    @property
    def holds_prompt(self) -> bool:
        """Whether the prompt is held whole for an adaptive cut at its end (not cut yet)."""
        held = self.slots is None or self.history is not None
        return self.allocation != "uniform" and self.lanes is None and held

    def protect(self, positions: mx.array, newest: Any) -> mx.array:
        """bool: sinks and the ``recent`` newest positions (``newest``: the newest one)."""
        return sinks(positions, self.n_sink) | (positions > newest - self.recent)

    @property
    def rule(self) -> Rule:
        return Rule(
            self.budget,
            self.n_sink,
            self.signal,
            self.scope,
            self.prefill,
            recent=self.recent,
        )


def init_h2o_state(
    budget: int = 512,
    n_sink: int = 4,
    recent: int | None = None,
    signal: Signal = "query",
    scope: Scope = "head",
    prefill: Prefill = "sequential",
    allocation: str = "uniform",
    allocation_floor: float = LN.FLOOR,
) -> H2OState:
    """Empty H2O state. ``recent`` defaults to ``budget // 2`` (the H2O paper's split);
    ``n_sink + recent <= budget``; ``allocation`` ``uniform`` or, with scope ``head``,
    ``head`` or ``global`` (see the module doc); ``0 <= allocation_floor <= 1``."""
    check_budget_and_sinks(budget, n_sink)
    LN.check_allocation(allocation, allocation_floor)
    if allocation != "uniform" and scope != "head":
        raise ValueError(
            f"allocation={allocation!r} shares rows across KV heads: it needs scope='head' "
            f"(got scope={scope!r})"
        )
    recent = budget // 2 if recent is None else recent
    check_int("recent", recent, minimum=0)
    if n_sink + recent > budget:
        raise ValueError(
            f"recent must be <= budget - n_sink ({budget - n_sink}) so a token can be evicted, "
            f"got {recent}"
        )
    return H2OState(
        budget=budget,
        n_sink=n_sink,
        recent=recent,
        signal=check_choice("signal", signal, SIGNALS),  # type: ignore[arg-type]
        scope=check_choice("scope", scope, SCOPES),  # type: ignore[arg-type]
        prefill=check_choice("prefill", prefill, PREFILLS),  # type: ignore[arg-type]
        allocation=allocation,
        allocation_floor=float(allocation_floor),
    )


def h2o_rule(state: H2OState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Add this call's weights to the running sums; evict the lowest sum."""
    B, H_kv, L, _ = call.shape
    G = state.rule.groups(H_kv)
    scores = state.scores
    if scores is None:
        scores = mx.zeros((B, G, 0), dtype=mx.float32)
    scores = align_scores(scores, slots, G, L)
    if state.holds_prompt:  # the sums accumulate over the whole prompt: nothing goes yet
        held = replace(state.rule, budget=_NEVER)
        decision, scores = decide_by_weights(held, call, candidates, scores=scores)
        probe = call.probe(state.signal)
        last = History(probe[:, :, -1:], call.positions()[-1:])
        return replace(decision, changes={"scores": scores, "history": last})
    decision, scores = decide_by_weights(state.rule, call, candidates, scores=scores)
    return replace(decision, changes={"scores": scores})


_NEVER = 2**30  # a budget no prompt reaches


def _cut_scores(state: H2OState) -> tuple[KVSlots, mx.array, mx.array] | None:
    """The held prompt's rows, their sums and the rows the cut spares (sinks, the recent
    window before the next token), or ``None`` when nothing is to cut."""
    if not state.holds_prompt or state.slots is None or state.scores is None:
        return None
    live = state.slots.compact()
    if live.n_slots <= state.budget:
        return None
    return live, state.scores, state.protect(live.positions, state.offset)


def _cut(state: H2OState, total: int | None) -> H2OState:
    """The held prompt cut into per-head shares by its sums (``total``: the layer's rows
    under ``global``; ``None``: ``budget * H``), lanes carrying the sums with one dead row per
    head; a prompt within ``budget`` is not cut (H2O goes on uniformly)."""
    found = _cut_scores(state)
    if found is None:
        return replace(state, history=None) if state.holds_prompt else state
    live, scores, _ = found
    return LN.cut_evicting(
        state,
        live,
        scores,
        lambda positions: state.protect(positions, state.offset),
        name="h2o",
        keep_scores=True,
        total=total,
        history=None,
        scores=None,
    )


def h2o_cut(state: H2OState, call: Call) -> H2OState:
    """The held prompt cut at its end (the first single-token call) into per-head shares by
    its attention sums (lanes carrying the sums, one dead row per head). A prompt within
    ``budget`` is not cut: H2O then goes on uniformly. ``global`` is cut by the model's
    linked layers together (see the module doc)."""
    return _cut(state, None)


H2O_GLOBAL = LN.GlobalRule(
    pending=lambda state: state.holds_prompt,
    scores=_cut_scores,
    cut=_cut,
    spare=2,
    when="first_token",
)


def _h2o_score(state: Any, lanes: LN.Lanes, weights: mx.array | None) -> tuple[mx.array, mx.array]:
    assert weights is not None and lanes.scores is not None
    sums = lanes.scores + weights
    return sums, sums


H2O_LANES = LN.LaneRule(
    cut=h2o_cut,
    probe=lambda state: state.signal,
    protect=lambda state, positions, newest: state.protect(positions, newest),
    score=_h2o_score,
)


H2O = Policy(
    "h2o",
    H2OState,
    init_h2o_state,
    h2o_rule,
    packs_rows=True,
    compiled_decode=True,
    traits=read_settings("signal", "scope", "prefill", "budget"),
    lane_rule=H2O_LANES,
    global_rule=H2O_GLOBAL,
    summary={
        "h2o": "keeps the tokens with the most attention summed so far plus the recent ones (H2O)",
    },
    help={
        "recent": "latest tokens always kept (default: budget // 2)",
        "allocation": "uniform: budget rows per KV head; head (scope head only): the prompt is "
        "held, then its end shares the layer's rows across heads by the sums (AdaKV); global: "
        "across every head of every layer",
        "allocation_floor": "a head's least share under head allocation, a fraction of budget",
    },
)
h2o_update = H2O.update
