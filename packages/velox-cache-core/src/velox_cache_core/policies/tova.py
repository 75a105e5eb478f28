"""TOVA: Token Omission Via Attention (Oren et al., 2024, https://arxiv.org/abs/2401.06104).

At every step the model attends over ``retained + new``; if that exceeds ``budget`` the token
with the lowest current-step attention weight is dropped (sinks excepted, the newest token
included). Nothing is carried between steps: the state holds no scores.
"""

from __future__ import annotations

from dataclasses import dataclass

from velox_cache_core.attention_rule import Rule, decide_by_weights
from velox_cache_core.engine import Call, Decision, Step
from velox_cache_core.registry import Policy
from velox_cache_core.scoring import Scope
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState
from velox_cache_core.traits import Prefill, Signal, read_settings
from velox_cache_core.validation import check_budget_and_sinks, check_choice

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")
PREFILLS = ("sequential", "oneshot")
PRESETS: dict[str, dict[str, str]] = {
    # Paper-faithful: true-query weights averaged over the layer's heads (Table 3's best).
    "tova": {"signal": "query", "scope": "layer", "prefill": "sequential"},
    # The seed's TOVA-adapted: the incoming key as proxy query, one decision per KV head.
    "tova_adapted": {"signal": "key", "scope": "head", "prefill": "sequential"},
}


@dataclass(frozen=True, kw_only=True)
class TovaState(PolicyState):
    """One layer's TOVA cache: settings, retained slots and counters.

    ``slots`` is ``None`` until the first call fixes ``B``, ``H_kv``, ``D`` and dtype. Views:
    ``keys``, ``values``, ``positions``, ``n_kept``, ``nbytes``, ``compression_ratio``.
    """

    budget: int
    n_sink: int
    signal: Signal
    scope: Scope
    prefill: Prefill

    @property
    def rule(self) -> Rule:
        return Rule(self.budget, self.n_sink, self.signal, self.scope, self.prefill)


TovaStep = Step
"""``keys``/``values`` ``[B, H_kv, n, D]`` attended by this call, ``mask``, next ``state``."""


def init_tova_state(
    budget: int = 512,
    n_sink: int = 4,
    signal: Signal | None = None,
    scope: Scope | None = None,
    prefill: Prefill | None = None,
    preset: str = "tova",
) -> TovaState:
    """An empty TOVA state. ``signal``/``scope``/``prefill`` override the preset's values."""
    check_choice("preset", preset, PRESETS)
    check_budget_and_sinks(budget, n_sink)
    chosen = {**PRESETS[preset]}
    for name, value, options in (
        ("signal", signal, SIGNALS),
        ("scope", scope, SCOPES),
        ("prefill", prefill, PREFILLS),
    ):
        if value is not None:
            chosen[name] = check_choice(name, value, options)
    return TovaState(budget=budget, n_sink=n_sink, **chosen)  # type: ignore[arg-type]


def tova_rule(state: TovaState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Evict the lowest current-step weight (memoryless)."""
    return decide_by_weights(state.rule, call, candidates)[0]


TOVA = Policy(
    "tova",
    TovaState,
    init_tova_state,
    tova_rule,
    presets=PRESETS,
    packs_rows=True,
    traits=read_settings("signal", "scope", "prefill", "budget"),
    summary={
        "tova": "drops the token the newest query attends to least (TOVA)",
        "tova_adapted": "TOVA scored with the new key in place of the query, per KV head",
    },
)
tova_update = TOVA.update
