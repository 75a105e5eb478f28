"""Expected Attention over an adaptive allocation's lanes (``allocation='head'`` or
``'global'``, :mod:`velox_cache_core.lanes`): after the prompt's cut each KV head's rows live in
lanes of ``W`` rows, and the policy scores them per lane (the policy:
:mod:`velox_cache_core.policies.expected_attention`; its scores:
:mod:`velox_cache_core.policies.expected_scores`).

Shapes: ``B`` rows of the batch, ``H`` KV heads, ``N`` lanes of ``W`` rows, ``G`` query heads
per KV head, ``D`` head size.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_cache_core.attention_rule import History
from velox_cache_core.engine import Call
from velox_cache_core.lanes import LaneRule, Lanes, put_rows, rows_at, write
from velox_cache_core.policies.expected_scores import (
    QueryStats,
    arrival_scores,
    expected_logits,
    remember,
    scores_from_logits,
    window_stats,
)
from velox_cache_core.selection import sinks
from velox_cache_core.store import rows


def kv_heads(state: Any) -> int:
    """KV heads of a state cut into lanes (its slot store, emptied by the cut, keeps them)."""
    assert state.slots is not None
    return int(state.slots.keys.shape[1])


def rescore_lanes(
    state: Any, window: History, lanes: Lanes, *, offset: int, scale: float
) -> dict[str, Any]:
    """Fresh statistics from ``window`` and every row of ``lanes`` (none dead) re-scored, the
    softmax normalised per head across its lanes (non-sinks counted): the fields that change."""
    keys = rows.dense(lanes.keys)  # [B, N, W, D]
    B, D = int(keys.shape[0]), int(keys.shape[3])
    stats = window_stats(state, window, D, offset)
    H_q, H = int(stats.mean.shape[1]), kv_heads(state)
    G, N = H_q // H, lanes.n_lanes
    # each lane's owner's statistics, so the lanes are scored as N heads
    mean = lanes.per_lane(stats.mean.reshape(B, H, G, D)).reshape(B, N * G, D)
    cov = stats.cov
    if cov is not None:
        cov = lanes.per_lane(cov.reshape(B, H, G, D, D)).reshape(B, N * G, D, D)
    logits = expected_logits(QueryStats(mean, cov), keys, scale)  # [B, N, G, W]
    counted = ~sinks(lanes.positions, state.n_sink)[:, :, None]
    per_lane = mx.logsumexp(mx.where(counted, logits, -mx.inf), axis=-1)  # [B, N, G]
    member = lanes.member(H)[..., None]  # [B, H, N, 1]
    per_head = mx.logsumexp(mx.where(member, per_lane[:, None], -mx.inf), axis=2)  # [B, H, G]
    lane_norm = lanes.per_lane(per_head)[..., None]  # [B, N, G, 1]
    scores = scores_from_logits(
        logits, lane_norm, lanes.values, use_vnorm=state.use_vnorm, epsilon=state.epsilon
    )
    return {
        "mean": stats.mean,
        "cov": stats.cov,
        "log_norm": per_head.reshape(B, H_q),
        "scores": scores,
        "steps": 0,
    }


def lanes_observe(state: Any, call: Call) -> dict[str, Any]:
    """A call over lanes: its queries join the window; when the statistics are due, they are
    recomputed with the call's first token written into its heads' dead rows, every row
    re-scored (``scores``, read by :func:`lane_score` at that token)."""
    window = remember(state, call)
    steps = state.steps + call.length
    changes: dict[str, Any] = {
        "queries": window,
        "scale": call.scale,
        "steps": steps,
        "refreshed_at": None,
    }
    if steps < state.refresh_every or state.lanes is None:
        return changes
    at = call.start if call.row_start is None else call.row_start
    written = write(state.lanes, call.keys[:, :, :1], call.values[:, :, :1], at)
    end = call.start + call.length
    changes.update(rescore_lanes(state, window, written, offset=end, scale=call.scale))
    changes["refreshed_at"] = call.start
    return changes


def lane_score(state: Any, lanes: Lanes, weights: mx.array | None) -> tuple[mx.array, mx.array]:
    """The lanes' scores with the newest token's row (one per head) scored on arrival with the
    current statistics, or every row's fresh scores at the step that refreshed them."""
    assert lanes.scores is not None and state.log_norm is not None and state.scale is not None
    B, N, W = lanes.positions.shape
    H = kv_heads(state)
    flat = lanes.positions.reshape(B, N * W)
    newest = flat.max(axis=-1, keepdims=True)  # [B, 1]
    mine = lanes.row_member(H) & (flat == newest)[:, None]
    idx = mx.argmax(mx.where(mine, 1, 0), axis=-1).astype(mx.int32)  # [B, H]
    new = rows_at(lanes, idx)  # [B, H, 1, D]
    fresh = arrival_scores(state, new.keys, new.values, state.scale)  # [B, H, 1]
    scores = put_rows(lanes.scores, idx, fresh)
    if state.refreshed_at is not None and state.scores is not None:
        scores = mx.where(newest.reshape(B, 1, 1) == state.refreshed_at, state.scores, scores)
    return scores, scores


EA_LANES = LaneRule(
    cut=lambda state, call: state,  # the prompt's end cuts (expected_attention_compress)
    probe=lambda state: None,
    protect=lambda state, positions, newest: state.protect(positions, newest),
    score=lane_score,
    observe=lanes_observe,
)
