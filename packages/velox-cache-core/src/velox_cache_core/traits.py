"""What a policy declares about its states, so that nobody probes them.

The engine, the layer lifecycle (:mod:`velox_cache_core.layer`) and every adapter ask a policy's
:class:`Traits` (which attention signal a state scores with, whether it decides per layer or
per head, how it prefills, its budget, whether it holds rows only masks hide) instead of
``getattr(state, "signal", None)``. A policy without a setting leaves the default trait, which
says what the engine assumes of such a policy.

A model-driven phase (:class:`Compressor`) is declared the same way: KVzip's reconstruction
pass is one, and any policy that scores its context by a pass through the model declares its
own; ``velox_mlx_lm.compress`` drives it for every such policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Literal

import mlx.core as mx

Signal = Literal["query", "key"]
Scope = Literal["layer", "head"]
Prefill = Literal["sequential", "oneshot"]


def _no_signal(state: Any) -> Signal | None:
    return None


def _layer_scope(state: Any) -> Scope:
    return "layer"


def _no_prefill(state: Any) -> Prefill | None:
    return None


def _no_budget(state: Any) -> int | None:
    return None


def _no_hidden_rows(state: Any) -> bool:
    return False


@dataclass(frozen=True)
class Traits:
    """Typed questions about one of a policy's states, each with a default.

    signal: what scores candidates: ``"query"`` (the true queries, which only the attention
    hook brings), ``"key"`` (the new keys) or ``None`` (the rule reads no attention).
    scope: ``"layer"`` (one decision, the same positions in every head; the chunk mask is
    shared by every head) or ``"head"`` (one decision per KV head).
    prefill: ``"sequential"`` (a chunk decides token by token, so it may be split anywhere),
    ``"oneshot"`` or ``None`` (the policy has no such setting).
    budget: the rows per head a decode step evicts down to (``None``: no budget).
    hides_rows: whether the state holds rows that only the policy's masks hide (KVzip's pad
    slots): a model attending by itself, without the hook, would see them.
    """

    signal: Callable[[Any], Signal | None] = _no_signal
    scope: Callable[[Any], Scope] = _layer_scope
    prefill: Callable[[Any], Prefill | None] = _no_prefill
    budget: Callable[[Any], int | None] = _no_budget
    hides_rows: Callable[[Any], bool] = _no_hidden_rows


def read_settings(*names: str, **others: Callable[[Any], Any]) -> Traits:
    """Traits answered by the state's settings of the same names (``"signal"``, ``"scope"``,
    ``"prefill"``, ``"budget"``), plus ``others`` given as functions of the state."""
    known = {"signal", "scope", "prefill", "budget", "hides_rows"}
    unknown = sorted((set(names) | set(others)) - known)
    if unknown:
        raise ValueError(f"traits must be among {sorted(known)}, got {unknown}")
    return Traits(**{name: attrgetter(name) for name in names}, **others)


# score(state, queries, keys, start, end, scale) -> float32 [B, H_kv, end - start]: the scores
# one pass chunk gives context rows start..end-1 (queries [B, H_q, L, D] and the chunk's own
# keys [B, H_kv, L, D], which are attended to but never stored).
ScoreChunk = Callable[[Any, mx.array, mx.array, int, int, float], mx.array]


@dataclass(frozen=True)
class Compressor:
    """A model-driven phase: the context is scored by a pass through the model that a cache
    alone cannot run, then cut.

    needs_pass(state): whether this state is compressed by such a pass (else its prompt end
    does the cut by itself, and the phase is only ``Policy.end_prompt``).
    check(state): raises ``ValueError`` unless the state can enter the phase (a whole,
    uncompressed context).
    score: see :data:`ScoreChunk`; the pass's chunks must cover the context once, in order.
    cut(state, scores, total): the state cut by ``scores`` (float32 ``[B, H_kv, n]``, every
    context row's); ``total``: the layer's share of a model-wide row total, or ``None``.
    shares(scores, state): per layer, the row total a model-wide allocation gives it, from
    every layer's scores (``[None] * layers`` when each layer cuts on its own).
    """

    needs_pass: Callable[[Any], bool]
    check: Callable[[Any], None]
    score: ScoreChunk
    cut: Callable[[Any, mx.array, int | None], Any]
    shares: Callable[[list[mx.array], Any], list[int | None]]
