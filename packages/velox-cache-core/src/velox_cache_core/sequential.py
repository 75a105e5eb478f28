"""Sequential prefill: a chunk's evictions taken in order, as if fed token by token.

Query ``i`` of a chunk sees exactly the candidates alive at step ``i``; after attending, if more
than ``budget`` are alive, the candidate with the lowest weight (or, for an accumulating rule,
the lowest running score) goes. The chunk's logits are computed once; only the cheap per-step
decisions run in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx

from velox_cache_core.distributed import decision_group, head_mean
from velox_cache_core.history import History
from velox_cache_core.scoring import Scope, exp
from velox_cache_core.selection import lowest_weight, sinks


@dataclass(frozen=True)
class Rule:
    """How a policy turns attention weights into evictions."""

    budget: int
    n_sink: int
    signal: str
    scope: Scope
    prefill: str
    window: int = 1  # probe rows fused per decision (MorphKV)
    fusion: str = "mean"
    recent: int = 0  # newest positions never evicted (H2O)
    # the state's pinned spans, int32 [B, P, 2] (velox_cache_core.pins), never evicted
    pins: mx.array | None = field(default=None, compare=False)
    # earlier probe rows fused with the call's (MorphKV's last ``window - 1``)
    history: History | None = field(default=None, compare=False)

    def groups(self, n_kv_heads: int) -> int:
        return 1 if self.scope == "layer" else n_kv_heads

    def protected(self, positions: mx.array, newest: int | mx.array) -> mx.array:
        """bool: sinks, pinned spans, and the ``recent`` newest positions when the newest is
        ``newest``."""
        out = sinks(positions, self.n_sink, self.pins)
        if self.recent:
            out = out | (positions > newest - self.recent)
        return out


def fuse_rows(weights: mx.array, fusion: str) -> mx.array:
    """``[B, G, W, n]`` per-row weights -> ``[B, G, n]`` (mean or max over the ``W`` rows)."""
    return weights.max(axis=2) if fusion == "max" else weights.mean(axis=2)


def _decide(
    exp_rows: mx.array,
    evict_step: mx.array,
    scores: mx.array,
    step: mx.array,
    limit: mx.array,
    protected: mx.array,
    positions: mx.array,
    *,
    fusion: str,
    accumulate: bool,
    recent: int,
    over: Any,
) -> tuple[mx.array, mx.array]:
    """One step: weights over the alive candidates, optional running sum, evict the lowest."""
    alive = (positions <= limit) & (evict_step >= step)
    e = exp_rows * alive[:, :, None, None, :]
    z = mx.maximum(e.sum(axis=-1, keepdims=True), 1e-30)
    weights = fuse_rows(head_mean(e / z, 2, over), fusion)
    if accumulate:
        scores = scores + weights
        weights = scores
    excluded = protected | ~alive
    if recent:
        excluded = excluded | (positions > limit - recent)
    victim = lowest_weight(weights, positions, excluded)
    cols = mx.arange(evict_step.shape[-1])
    return mx.where(cols == victim[..., None], step, evict_step), scores


@cache
def _compiled(fusion: str, accumulate: bool, recent: int, over: Any):  # type: ignore[no-untyped-def]
    """One step compiled; ``over``: what its head average spans (a traced ``all_sum`` over it,
    :func:`velox_cache_core.distributed.decision_group`), part of the key."""

    def decide(*args: mx.array) -> tuple[mx.array, mx.array]:
        return _decide(*args, fusion=fusion, accumulate=accumulate, recent=recent, over=over)

    return mx.compile(decide)


_EVAL_EVERY = 64


def row_visibility(positions: mx.array, row_positions: mx.array) -> mx.array:
    """bool ``[B, G, R, n]``: probe row ``r`` may see candidate ``j`` (``pos_j <= pos_r``)."""
    return positions[:, :, None, :] <= row_positions[:, None]


def eviction_steps(
    logits: mx.array,
    row_positions: mx.array,
    positions: mx.array,
    rule: Rule,
    *,
    start: int,
    length: int,
    scores: mx.array | None,
) -> tuple[mx.array, mx.array | None]:
    """Step at which each candidate is evicted (``length`` if it survives the chunk).

    logits: ``[B, G, H_d, R, n]`` probe logits over the candidates, rows at ``row_positions``
    (int ``[R]``): earlier probes, then the chunk's ``length``. Step ``i`` of the chunk
    (position ``start + i``) fuses its own row and up to ``rule.window - 1`` rows before it.
    positions: int32 ``[B, G, n]``; sinks, pinned spans (:mod:`velox_cache_core.pins`) and
    the ``rule.recent`` newest are never evicted. ``scores`` (``[B, G, n]``), if given,
    accumulate every step's weights and decide instead of them. A layer-wide decision
    (``rule.scope``) averages over every rank's heads under tensor parallelism (one ``all_sum``
    per step, :func:`velox_cache_core.distributed.decision_group`).
    Returns int32 ``[B, G, n]`` and the final scores.
    """
    n_history = int(row_positions.shape[0]) - length
    B, G, _, _, n = logits.shape
    over = decision_group(rule.scope)
    n_live = n - length  # candidates are the live rows, then the chunk
    assert scores is None or rule.window == 1, "accumulating rules fuse one row per step"
    visible = row_visibility(positions, row_positions)[:, :, None]  # [B, G, 1, R, n]
    row_max = mx.where(visible, logits, -mx.inf).max(axis=-1, keepdims=True)
    exp_rows = exp(logits - row_max) * visible
    evict_step = mx.full((B, G, n), length, dtype=mx.int32)
    protected = sinks(positions, rule.n_sink, rule.pins)
    first = max(0, rule.budget - n_live)
    accumulate = scores is not None
    if accumulate and first:
        # Before the first eviction nothing is missing: every row sees all it could.
        e = exp_rows[:, :, :, n_history : n_history + min(first, length)]
        assert scores is not None
        scores = scores + head_mean(e / e.sum(axis=-1, keepdims=True), 2, over).sum(axis=2)
    if scores is None:
        scores = mx.zeros((1,))
    decide = _compiled(rule.fusion, accumulate, rule.recent, over)
    # The scan is a long chain of small steps: evaluating the shared inputs first and the chain
    # every few steps keeps each step's graph small (measured 5x faster on CPU than one big graph).
    mx.eval(exp_rows, positions, protected, evict_step, scores)
    for i in range(first, length):
        if (i - first) % _EVAL_EVERY == _EVAL_EVERY - 1:
            mx.eval(evict_step, scores)
        row = n_history + i
        evict_step, scores = decide(
            exp_rows[:, :, :, max(0, row + 1 - rule.window) : row + 1],
            evict_step,
            scores,
            mx.array(i, dtype=mx.int32),
            mx.array(start + i, dtype=mx.int32),
            protected,
            positions,
        )
    return evict_step, (scores if accumulate else None)


def alive_mask(evict_step: mx.array, positions: mx.array, start: int, length: int) -> mx.array:
    """bool ``[B, G, L, n]``: candidate ``j`` is alive when query ``i`` attends."""
    steps = mx.arange(length)
    arrived = positions[:, :, None, :] <= (steps + start)[:, None]
    return arrived & (steps[:, None] <= evict_step[:, :, None, :])
