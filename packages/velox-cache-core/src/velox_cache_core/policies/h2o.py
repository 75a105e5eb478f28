"""H2O: Heavy-Hitter Oracle (Zhang et al., 2023, https://arxiv.org/abs/2306.14048).

Every retained token accumulates the attention it receives from every query that sees it (the
prompt's too); the lowest running sum is evicted, except sinks and the ``recent`` newest
tokens. Inertial where TOVA is memoryless: the state carries the scores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from velox_cache_core.attention_rule import Rule, align_scores, decide_by_weights
from velox_cache_core.engine import Call, Decision
from velox_cache_core.policies.tova import PREFILLS, SCOPES, SIGNALS
from velox_cache_core.registry import Policy
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState, running
from velox_cache_core.traits import Prefill, Scope, Signal, read_settings
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
    scores: mx.array | None = running()

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
) -> H2OState:
    """Empty H2O state. ``recent`` defaults to ``budget // 2`` (the H2O paper's split);
    ``n_sink + recent <= budget``."""
    check_budget_and_sinks(budget, n_sink)
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
    )


def h2o_rule(state: H2OState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Add this call's weights to the running sums; evict the lowest sum."""
    B, H_kv, L, _ = call.shape
    G = state.rule.groups(H_kv)
    scores = state.scores
    if scores is None:
        scores = mx.zeros((B, G, 0), dtype=mx.float32)
    scores = align_scores(scores, slots, G, L)
    decision, scores = decide_by_weights(state.rule, call, candidates, scores=scores)
    return replace(decision, changes={"scores": scores})


H2O = Policy(
    "h2o",
    H2OState,
    init_h2o_state,
    h2o_rule,
    packs_rows=True,
    traits=read_settings("signal", "scope", "prefill", "budget"),
    summary={
        "h2o": "keeps the tokens with the most attention summed so far plus the recent ones (H2O)",
    },
    help={
        "recent": "latest tokens always kept (default: budget // 2)",
    },
)
h2o_update = H2O.update
