"""TOVA: Token Omission Via Attention (Oren et al., 2024, https://arxiv.org/abs/2401.06104).

At every step the model attends over ``retained + new``; if that exceeds ``budget`` the token
with the lowest current-step attention weight is dropped (sinks excepted, the newest token
included). Nothing is carried between steps: the state holds no scores.

``allocation="head"`` (AdaKV) or ``"global"``, with scope ``head``: the prompt is held whole
and cut at the first single-token call (so its last token is decided over the shares), by its
last token's weights, into per-head shares of the layer's rows (``global``: of every layer's;
:mod:`velox_cache_core.allocation`); every decode step then evicts within its head's share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.allocation import HeldPrompt, holding, last_probe, shares
from velox_cache_core.attention_rule import RuleState, decide_by_weights, rule_choices
from velox_cache_core.declarations import Prefill, Signal, read_settings, running
from velox_cache_core.engine import Call, Decision, Step
from velox_cache_core.lanes import Lanes
from velox_cache_core.policy import Policy
from velox_cache_core.scoring import Scope, decision_weights, grouped_logits
from velox_cache_core.selection import sinks
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks, check_choice

PRESETS: dict[str, dict[str, str]] = {
    # Paper-faithful: true-query weights averaged over the layer's heads (Table 3's best).
    "tova": {"signal": "query", "scope": "layer", "prefill": "sequential"},
    # The seed's TOVA-adapted: the incoming key as proxy query, one decision per KV head.
    "tova_adapted": {"signal": "key", "scope": "head", "prefill": "sequential"},
}


@dataclass(frozen=True, kw_only=True)
class TovaState(RuleState, shares.AllocationState):
    """One layer's TOVA cache: settings, retained slots and counters.

    ``slots`` is ``None`` until the first call fixes ``B``, ``H_kv``, ``D`` and dtype. Views:
    ``keys``, ``values``, ``positions``, ``n_kept``, ``nbytes``, ``compression_ratio``.
    """

    # the attention scale of the held prompt's calls (for a cut outside a call: global)
    scale: float | None = running()

    holds_prompt = property(holding)  # held whole for an adaptive cut at its end


TovaStep = Step
"""``keys``/``values`` ``[B, H_kv, n, D]`` attended by this call, ``mask``, next ``state``."""


def init_tova_state(
    budget: int = 512,
    n_sink: int = 4,
    signal: Signal | None = None,
    scope: Scope | None = None,
    prefill: Prefill | None = None,
    preset: str = "tova",
    allocation: str = "uniform",
    allocation_floor: float = shares.FLOOR,
) -> TovaState:
    """An empty TOVA state. ``signal``/``scope``/``prefill`` override the preset's values;
    ``allocation`` ``uniform`` or, with scope ``head``, ``head`` or ``global`` (see the
    module doc); ``0 <= allocation_floor <= 1``."""
    check_choice("preset", preset, PRESETS)
    check_budget_and_sinks(budget, n_sink)
    chosen = rule_choices(signal, scope, prefill, PRESETS[preset])
    return TovaState(
        budget=budget,
        n_sink=n_sink,
        **chosen,
        **shares.allocation_fields(allocation, allocation_floor, chosen["scope"]),
    )


def tova_rule(state: TovaState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Evict the lowest current-step weight (memoryless); while an adaptive allocation holds
    the prompt, keep everything and remember the last probe row."""
    if state.holds_prompt:
        return Decision(
            candidates, changes={"history": last_probe(state, call), "scale": call.scale}
        )
    return decide_by_weights(state.rule, call, candidates)[0]


def _prompt_scores(state: TovaState, live: KVSlots) -> mx.array:
    """The held prompt's rows scored by its last probe row's weights, per KV head."""
    assert state.history is not None and state.scale is not None
    logits = grouped_logits(state.history.probes, live.keys, state.scale, "head")
    return decision_weights(logits)[:, :, 0]  # [B, H_kv, n]


def _with_scale(state: TovaState, call: Call) -> TovaState:
    """The held state with the cutting call's scale, when the prompt's calls gave none."""
    if state.holds_prompt and state.scale is None:
        return replace(state, scale=call.scale)
    return state


def _tova_score(state: Any, lanes: Lanes, weights: mx.array | None) -> tuple[mx.array, None]:
    assert weights is not None
    return weights, None


# ``head``/``global`` allocation: the held prompt is cut by its last probe row's weights, and
# every later step evicts each head's lowest current-step weight (velox_cache_core.allocation)
TOVA_ALLOCATION = HeldPrompt(
    name="tova",
    ready=lambda state: state.history is not None,
    prompt_scores=_prompt_scores,
    protect=lambda state, positions, newest: sinks(positions, state.n_sink, state.pins),
    step_scores=_tova_score,
    keep_scores=False,
    cleared={"scale": None},
    prepare=_with_scale,
)


TOVA = Policy(
    "tova",
    TovaState,
    init_tova_state,
    tova_rule,
    presets=PRESETS,
    packs_rows=True,
    compiled_decode=True,
    traits=read_settings("signal", "scope", "prefill", "budget", "n_sink"),
    lane_rule=TOVA_ALLOCATION.lane_rule(),
    global_rule=TOVA_ALLOCATION.global_rule(),
    summary={
        "tova": "drops the token the newest query attends to least (TOVA)",
        "tova_adapted": "TOVA scored with the new key in place of the query, per KV head",
    },
    help={
        "allocation": "uniform: budget rows per KV head; head (scope head only): the prompt is "
        "held, then its end shares the layer's rows across heads by score (AdaKV); global: "
        "across every head of every layer",
        "allocation_floor": "a head's least share under head allocation, a fraction of budget",
    },
)
tova_update = TOVA.update
