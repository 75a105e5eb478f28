"""StreamingLLM: attention sinks plus a window of recent tokens (Xiao et al., 2024,
https://arxiv.org/abs/2309.17453).

Position ``t`` attends the ``n_sink`` first tokens and the ``budget - n_sink`` most recent ones
(itself included): the oldest non-sink is dropped *before* attending, as mlx-lm's
``RotatingKVCache(max_size=budget, keep=n_sink)`` does at decode. Positions stay true.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from velox_cache_core.engine import SlotStateMixin, Step, advance, chunk_candidates, open_call
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks


@dataclass(frozen=True)
class StreamingLLMState(SlotStateMixin):
    budget: int
    n_sink: int
    slots: KVSlots | None = None
    offset: int = 0
    tokens_seen: int = 0


def init_streaming_llm_state(budget: int = 512, n_sink: int = 4) -> StreamingLLMState:
    check_budget_and_sinks(budget, n_sink)
    return StreamingLLMState(budget=budget, n_sink=n_sink)


def window_mask(positions: mx.array, start: int, length: int, budget: int, n_sink: int) -> mx.array:
    """bool ``[B, 1, L, n]``: position ``start + i`` sees sinks and its ``budget - n_sink``
    most recent tokens. positions: int ``[B, 1, n]``."""
    t = (mx.arange(length) + start)[:, None]
    p = positions[:, :, None, :]
    return (p <= t) & ((p < n_sink) | (p > t - (budget - n_sink)))


def streaming_llm_update(
    state: StreamingLLMState,
    keys: mx.array,
    values: mx.array,
    queries: mx.array | None = None,
    scale: float | None = None,
    check_finite: bool = True,
) -> Step:
    """Append ``[B, H_kv, L, D]`` tokens; keep sinks and the most recent tokens.

    ``queries``/``scale`` are only validated (the rule ignores attention).
    """
    slots, call = open_call(
        state,
        StreamingLLMState,
        keys,
        values,
        queries,
        scale,
        check_finite=check_finite,
    )
    L, budget = call.length, state.budget
    positions = slots.positions[:, :1]
    if L == 0:
        live = slots.compact()
        return Step(live.keys, live.values, None, advance(state, slots, call))
    if L == 1:
        if slots.n_slots >= budget:  # drop the oldest non-sink, then write over it
            oldest = lowest_weight(
                positions.astype(mx.float32), positions, sinks(positions, state.n_sink)
            )
            slots = slots.with_free(oldest)
        candidates = (
            slots.write_free(call.keys, call.values, call.start)
            if slots.free is not None
            else slots.append(call.keys, call.values, call.positions())
        )
        return Step(candidates.keys, candidates.values, None, advance(state, candidates, call))
    candidates = chunk_candidates(slots, call)
    positions = candidates.positions[:, :1]
    mask = window_mask(positions, call.start, L, budget, state.n_sink)
    kept = candidates
    if candidates.n_slots > budget:
        newest_first = positions.astype(mx.float32)
        keep = highest_weights(newest_first, positions, sinks(positions, state.n_sink), budget)
        kept = candidates.take(keep)
    return Step(
        candidates.keys, candidates.values, call.expand(mask, "layer"), advance(state, kept, call)
    )
