"""TOVA: Token Omission Via Attention (Oren et al., 2024, https://arxiv.org/abs/2401.06104).

At every step the model attends over ``retained + new``; if that exceeds ``budget`` the token
with the lowest current-step attention weight is dropped (sinks excepted, the newest token
included). Nothing is carried between steps: the state holds no scores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import mlx.core as mx

from velox_cache_core.masks import chunk_causal, expand_heads
from velox_cache_core.scoring import Scope, decision_weights, grouped_logits
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.sequential import alive_mask, eviction_steps
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import (
    check_budget_and_sinks,
    check_choice,
    check_kv,
    check_queries,
    check_scale,
    require_finite,
)

Signal = Literal["query", "key"]
Prefill = Literal["sequential", "oneshot"]

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")
PREFILLS = ("sequential", "oneshot")
PRESETS: dict[str, dict[str, str]] = {
    # Paper-faithful: true-query weights averaged over the layer's heads (Table 3's best).
    "tova": {"signal": "query", "scope": "layer", "prefill": "sequential"},
    # The seed's TOVA-adapted: the incoming key as proxy query, one decision per KV head.
    "tova_adapted": {"signal": "key", "scope": "head", "prefill": "sequential"},
}


@dataclass(frozen=True)
class TovaState:
    """One layer's TOVA cache: settings, retained slots and counters.

    ``slots`` is ``None`` until the first call fixes ``B``, ``H_kv``, ``D`` and dtype.
    """

    budget: int
    n_sink: int
    signal: Signal
    scope: Scope
    prefill: Prefill
    slots: KVSlots | None = None
    offset: int = 0
    tokens_seen: int = 0

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "n_sink": self.n_sink,
            "signal": self.signal,
            "scope": self.scope,
            "prefill": self.prefill,
        }

    def _live(self) -> KVSlots | None:
        return None if self.slots is None else self.slots.compact()

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys, rows in slot order (same as ``positions``)."""
        live = self._live()
        return None if live is None else live.keys

    @property
    def values(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained values."""
        live = self._live()
        return None if live is None else live.values

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained rows."""
        live = self._live()
        return None if live is None else live.positions

    @property
    def n_kept(self) -> int:
        return 0 if self.slots is None else self.slots.n_kept

    @property
    def tokens_kept(self) -> int:
        """Retained tokens per (batch row, KV head)."""
        return self.n_kept

    @property
    def nbytes(self) -> int:
        """Bytes of the retained keys and values: ``B * H_kv * n_kept * D * 2 * itemsize``."""
        if self.slots is None:
            return 0
        B, H, _, D = self.slots.keys.shape
        return B * H * self.n_kept * D * 2 * self.slots.keys.dtype.size

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per head over tokens kept (1.0 until something is evicted)."""
        return self.offset / self.n_kept if self.n_kept else 1.0


@dataclass(frozen=True)
class TovaStep:
    """What one call's queries attend over, and the state after the call's evictions.

    keys, values: ``[B, H_kv, n, D]``; mask: ``None`` (all visible, only for ``L <= 1``) or bool
    ``[B, H, L, n]`` with ``H`` = 1 (scope ``layer``), ``H_q`` (scope ``head``, queries given) or
    ``H_kv`` (scope ``head``, no queries: repeat each row over its query group).
    """

    keys: mx.array
    values: mx.array
    mask: mx.array | None
    state: TovaState


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


def tova_update(
    state: TovaState,
    keys: mx.array,
    values: mx.array,
    queries: mx.array | None = None,
    scale: float | None = None,
    check_finite: bool = True,
) -> TovaStep:
    """Append ``L`` new tokens, return what their queries attend over, and evict to ``budget``.

    keys, values: ``[B, H_kv, L, D]`` already position-encoded; queries: ``[B, H_q, L, D]``,
    required for signal ``query``; scale: softmax scale (default ``1/sqrt(D)``).
    ``check_finite`` rejects NaN/inf input at the cost of one host sync per call.
    The input state is never modified; a failed call raises before anything is computed.
    """
    if not isinstance(state, TovaState):
        raise TypeError(f"state must be a TovaState, got {type(state).__name__}")
    slots = state.slots
    expect = None
    if slots is not None:
        B0, H0, _, D0 = slots.keys.shape
        expect = (B0, H0, D0)
    check_kv(keys, values, expect=expect, dtype=None if slots is None else slots.keys.dtype)
    if queries is not None:
        check_queries(queries, keys)
    elif state.signal == "query":
        raise ValueError("queries are required when signal='query' (or use signal='key')")
    B, H_kv, L, D = keys.shape
    scale = check_scale(scale, D)
    if check_finite:
        require_finite(keys=keys, values=values, queries=queries)

    if slots is None:
        slots = KVSlots.empty_like(keys, values)
    if L == 0:
        live = slots.compact()
        return TovaStep(live.keys, live.values, None, replace(state, slots=slots))

    probe = queries if state.signal == "query" else keys
    assert probe is not None
    t0, budget = state.offset, state.budget
    groups = 1 if state.scope == "layer" else H_kv
    if L == 1:
        if slots.free is not None:
            candidates = slots.write_free(keys, values, t0)
        else:
            candidates = slots.append(keys, values, mx.array([t0]))
        kept = candidates
        if candidates.n_slots > budget:
            weights = decision_weights(grouped_logits(probe, candidates.keys, scale, state.scope))
            positions = candidates.positions[:, :groups]
            victim = lowest_weight(weights[:, :, 0], positions, sinks(positions, state.n_sink))
            kept = candidates.with_free(victim)
        mask = None
    else:
        candidates = slots.append(keys, values, mx.arange(t0, t0 + L))
        n = candidates.n_slots
        n_retained = n - L
        positions = candidates.positions[:, :groups]
        kept = candidates
        if n <= budget:
            chunk_mask = chunk_causal(n_retained, L)
        elif state.prefill == "sequential":
            logits = grouped_logits(probe, candidates.keys, scale, state.scope)
            evict_step = eviction_steps(logits, n_retained, budget, positions, state.n_sink)
            chunk_mask = alive_mask(evict_step, n_retained, L)
            cols = mx.arange(n)
            survivors = mx.argsort(mx.where(evict_step == L, cols, n + cols), axis=-1)
            kept = candidates.take(survivors[..., :budget])
        else:
            logits = grouped_logits(probe[:, :, -1:], candidates.keys, scale, state.scope)
            weights = decision_weights(logits)[:, :, 0]
            protected = sinks(positions, state.n_sink)
            kept = candidates.take(highest_weights(weights, positions, protected, budget))
            chunk_mask = chunk_causal(n_retained, L)
        heads = 1 if state.scope == "layer" else (H_kv if queries is None else queries.shape[1])
        mask = expand_heads(chunk_mask, B, heads)

    after = replace(state, slots=kept, offset=t0 + L, tokens_seen=state.tokens_seen + B * H_kv * L)
    return TovaStep(candidates.keys, candidates.values, mask, after)
