"""H2O: Heavy-Hitter Oracle (Zhang et al., 2023, https://arxiv.org/abs/2306.14048).

Every retained token accumulates the attention it receives from every query that sees it (the
prompt's too); the lowest running sum is evicted, except sinks and the ``recent`` newest
tokens. Inertial where TOVA is memoryless: the state carries the scores.

``allocation="head"`` (AdaKV) or ``"global"``, with scope ``head``: the prompt is held whole
while its sums accumulate, then cut at the first single-token call, by those sums, into
per-head shares of the layer's rows (``global``: of every layer's;
:mod:`velox_cache_core.allocation`), each head keeping its sinks and recent window; decode
steps then evict within each head's share, the sums carried on the lanes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import mlx.core as mx

from velox_cache_core.allocation import HeldPrompt, holding, last_probe, shares
from velox_cache_core.attention_rule import (
    Rule,
    RuleState,
    align_scores,
    decide_by_weights,
    protect_recent,
    rule_choices,
)
from velox_cache_core.declarations import Prefill, Scope, Signal, read_settings, running
from velox_cache_core.engine import Call, Decision
from velox_cache_core.lanes import Lanes
from velox_cache_core.policy import Policy
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks, check_int


@dataclass(frozen=True, kw_only=True)
class H2OState(RuleState, shares.AllocationState):
    """H2O layer state. scores: float32 ``[B, G, S]`` running attention sums, slot-aligned
    (``G`` = 1 for scope ``layer``, ``H_kv`` for ``head``)."""

    recent: int
    scores: mx.array | None = running()

    holds_prompt = property(holding)  # held whole for an adaptive cut at its end

    protect = protect_recent

    @property
    def rule(self) -> Rule:
        return replace(super().rule, recent=self.recent)


def init_h2o_state(
    budget: int = 512,
    n_sink: int = 4,
    recent: int | None = None,
    signal: Signal = "query",
    scope: Scope = "head",
    prefill: Prefill = "sequential",
    allocation: str = "uniform",
    allocation_floor: float = shares.FLOOR,
) -> H2OState:
    """Empty H2O state. ``recent`` defaults to ``budget // 2`` (the H2O paper's split);
    ``n_sink + recent <= budget``; ``allocation`` ``uniform`` or, with scope ``head``,
    ``head`` or ``global`` (see the module doc); ``0 <= allocation_floor <= 1``."""
    check_budget_and_sinks(budget, n_sink)
    allocated = shares.allocation_fields(allocation, allocation_floor, scope)
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
        **rule_choices(signal, scope, prefill, {}),
        **allocated,
    )


def h2o_rule(state: H2OState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Add this call's weights to the running sums; evict the lowest sum."""
    B, H_kv, L, _ = call.shape
    G = state.rule.groups(H_kv)
    scores = mx.zeros((B, G, 0), dtype=mx.float32) if state.scores is None else state.scores
    scores = align_scores(scores, slots, G, L)
    held = state.holds_prompt  # the sums accumulate over the whole prompt: nothing goes yet
    rule = replace(state.rule, budget=_NEVER) if held else state.rule
    decision, sums = decide_by_weights(rule, call, candidates, scores=scores)
    changes = {"scores": sums, "history": last_probe(state, call)} if held else {"scores": sums}
    return replace(decision, changes=changes)


_NEVER = 2**30  # a budget no prompt reaches


def _h2o_score(state: Any, lanes: Lanes, weights: mx.array | None) -> tuple[mx.array, mx.array]:
    assert weights is not None and lanes.scores is not None
    sums = lanes.scores + weights
    return sums, sums


# ``head``/``global`` allocation: the held prompt is cut by its attention sums, which the lanes
# carry on, and every later step evicts each head's lowest sum (velox_cache_core.allocation)
H2O_ALLOCATION = HeldPrompt(
    name="h2o",
    ready=lambda state: state.scores is not None,
    prompt_scores=lambda state, live: state.scores,
    protect=protect_recent,
    step_scores=_h2o_score,
    keep_scores=True,
    cleared={"scores": None},
)


H2O = Policy(
    "h2o",
    H2OState,
    init_h2o_state,
    h2o_rule,
    packs_rows=True,
    compiled_decode=True,
    traits=read_settings(
        "signal", "scope", "prefill", "budget", "n_sink", reserved=attrgetter("recent")
    ),
    lane_rule=H2O_ALLOCATION.lane_rule(),
    global_rule=H2O_ALLOCATION.global_rule(),
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
    demote_scoring="accumulated",
)
h2o_update = H2O.update
