"""StreamingLLM: attention sinks plus a window of recent tokens (Xiao et al., 2024,
https://arxiv.org/abs/2309.17453).

Position ``t`` attends the ``n_sink`` first tokens and the ``budget - n_sink`` most recent ones
(itself included): the oldest non-sink is dropped *before* attending, as mlx-lm's
``RotatingKVCache(max_size=budget, keep=n_sink)`` does at decode. Positions stay true. Pinned
spans (:mod:`velox_cache_core.pins`) are kept like sinks, and the window is what they leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from velox_cache_core.declarations import PolicyState, read_settings
from velox_cache_core.engine import Call, Decision
from velox_cache_core.policy import Policy
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks


@dataclass(frozen=True, kw_only=True)
class StreamingLLMState(PolicyState):
    budget: int
    n_sink: int


def init_streaming_llm_state(budget: int = 512, n_sink: int = 4) -> StreamingLLMState:
    check_budget_and_sinks(budget, n_sink)
    return StreamingLLMState(budget=budget, n_sink=n_sink)


def window_mask(
    positions: mx.array,
    start: int,
    length: int,
    budget: int,
    n_sink: int,
    pins: mx.array | None = None,
) -> mx.array:
    """bool ``[B, 1, L, n]``: position ``start + i`` sees sinks and its ``budget - n_sink``
    most recent tokens. positions: int ``[B, 1, n]``.

    With ``pins`` (int32 ``[B, P, 2]`` disjoint spans): it sees sinks, the pinned tokens up to
    it and as many of its most recent other tokens as the budget leaves, as a cache that took
    the tokens one at a time and dropped the oldest unprotected one would hold."""
    t = (mx.arange(length) + start)[:, None]
    p = positions[:, :, None, :]
    if pins is None:
        return (p <= t) & ((p < n_sink) | (p > t - (budget - n_sink)))
    t5, p5 = t[None, None, :, :, None], p[..., None]  # [1, 1, L, 1, 1], [B, 1, 1, n, 1]
    lo = mx.maximum(pins[:, None, None, None, :, 0], n_sink)  # [B, 1, 1, 1, P]
    hi = pins[:, None, None, None, :, 1]

    def pinned_between(a: mx.array) -> mx.array:  # pinned non-sinks in [a, t], [B, 1, L, ?]
        return mx.maximum(mx.minimum(hi, t5 + 1) - mx.maximum(lo, a), 0).sum(axis=-1)

    room = budget - mx.minimum(n_sink, t + 1) - pinned_between(mx.zeros_like(p5))
    others = (t - p + 1) - pinned_between(p5)  # unprotected tokens in [p, t] for p unprotected
    kept = sinks(positions, n_sink, pins)[:, :, None, :]
    return (p <= t) & (kept | (others <= room))


def drop_oldest(state: StreamingLLMState, slots: KVSlots, call: Call) -> KVSlots:
    """Decode: when full, free the oldest non-sink before the new token attends."""
    if slots.n_slots < state.budget:
        return slots
    positions = slots.positions[:, :1]
    protected = sinks(positions, state.n_sink, state.pins)
    oldest = lowest_weight(positions.astype(mx.float32), positions, protected)
    return slots.with_free(oldest)


def streaming_llm_rule(
    state: StreamingLLMState, call: Call, slots: KVSlots, candidates: KVSlots
) -> Decision:
    """A chunk: each query sees sinks and its recent window; keep sinks and the newest."""
    if call.length == 1:  # drop_oldest already made room
        return Decision(candidates)
    positions = candidates.positions[:, :1]
    mask = window_mask(positions, call.start, call.length, state.budget, state.n_sink, state.pins)
    kept = candidates
    if candidates.n_slots > state.budget:
        newest_first = positions.astype(mx.float32)
        protected = sinks(positions, state.n_sink, state.pins)
        kept = candidates.take(highest_weights(newest_first, positions, protected, state.budget))
    return Decision(kept, mask)


STREAMING_LLM = Policy(
    "streaming_llm",
    StreamingLLMState,
    init_streaming_llm_state,
    streaming_llm_rule,
    uses_queries=False,
    evict_before=drop_oldest,
    packs_rows=True,
    compiled_decode=True,
    traits=read_settings("budget", "n_sink"),
    summary={
        "streaming_llm": "keeps the first tokens and a sliding window of the latest (StreamingLLM)",
    },
    help={"budget": "tokens kept: sinks plus the latest", "n_sink": "first positions kept"},
    demote_scoring="recency",
)
streaming_llm_update = STREAMING_LLM.update
