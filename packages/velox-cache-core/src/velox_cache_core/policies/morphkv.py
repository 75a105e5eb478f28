"""MorphKV: TOVA's current-step weights fused over the last ``window`` probe rows.

Ghadia et al., 2025, "Dialogue Without Limits: Constant-Sized KV Caches for Extended Responses
in LLMs" (https://arxiv.org/abs/2503.00979): the recent tokens' attention decides which older
tokens stay. Each of the last ``window`` queries (or keys, signal ``key``) attends over the
candidates it precedes; the weights are averaged (``mean``) or max-fused (``max``). The
``window - 1`` newest tokens, which not every row can see, are kept (the paper's recent
window). With ``window=1`` this is TOVA, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from velox_cache_core.attention_rule import (
    Rule,
    RuleState,
    decide_by_weights,
    extended,
    rule_choices,
)
from velox_cache_core.declarations import Prefill, Scope, Signal, read_settings
from velox_cache_core.engine import Call, Decision
from velox_cache_core.policies.tova import PRESETS
from velox_cache_core.policy import Policy
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks, check_choice, check_int

FUSIONS = ("mean", "max")
Fusion = Literal["mean", "max"]


@dataclass(frozen=True, kw_only=True)
class MorphKVState(RuleState):
    """MorphKV layer state: TOVA's plus the last ``window - 1`` probe rows."""

    window: int
    fusion: Fusion

    @property
    def rule(self) -> Rule:
        return replace(
            super().rule,
            window=self.window,
            fusion=self.fusion,
            recent=self.window - 1,
            history=self.history,
        )


def init_morphkv_state(
    budget: int = 512,
    n_sink: int = 4,
    window: int = 8,
    fusion: Fusion = "mean",
    signal: Signal | None = None,
    scope: Scope | None = None,
    prefill: Prefill | None = None,
) -> MorphKVState:
    """Empty MorphKV state; signal/scope/prefill default to the ``tova`` preset's."""
    check_budget_and_sinks(budget, n_sink)
    check_int("window", window, minimum=1)
    if n_sink + window - 1 > budget:
        raise ValueError(
            f"window must be <= budget - n_sink + 1 ({budget - n_sink + 1}) so a token can be "
            f"evicted, got {window}"
        )
    check_choice("fusion", fusion, FUSIONS)
    return MorphKVState(
        budget=budget,
        n_sink=n_sink,
        window=window,
        fusion=fusion,
        **rule_choices(signal or None, scope or None, prefill or None, PRESETS["tova"]),
    )


def morphkv_rule(state: MorphKVState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """TOVA's rule over the fused window; the state keeps the last ``window - 1`` probe rows."""
    decision = decide_by_weights(state.rule, call, candidates)[0]
    history = extended(state.history, call.probe(state.signal), call.positions(), state.window - 1)
    return replace(decision, changes={"history": history})


MORPHKV = Policy(
    "morphkv",
    MorphKVState,
    init_morphkv_state,
    morphkv_rule,
    compiled_decode=True,
    # reserved: the newest window - 1 rows, which the fused window's rows still read
    traits=read_settings(
        "signal", "scope", "prefill", "budget", "n_sink", reserved=lambda state: state.window - 1
    ),
    summary={
        "morphkv": "drops the token the last few queries attend to least (MorphKV)",
    },
    help={
        "window": "latest queries whose weights are fused",
        "fusion": "how the window's weights are fused",
    },
)
morphkv_update = MORPHKV.update
