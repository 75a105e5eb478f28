"""Sequential prefill: a chunk's evictions taken in order, as if fed token by token.

Query ``i`` of a chunk sees exactly the candidates alive at step ``i``; after attending, if more
than ``budget`` are alive, the lowest current-step weight goes. The chunk's logits are computed
once; only the ``L`` cheap decisions run in order.
"""

from __future__ import annotations

import mlx.core as mx

from velox_cache_core.scoring import exp
from velox_cache_core.selection import lowest_weight


def _decide(
    exp_row: mx.array,
    evict_step: mx.array,
    step: mx.array,
    visible: mx.array,
    protected: mx.array,
    positions: mx.array,
) -> mx.array:
    """One step: normalise over the alive candidates, evict the lowest, record the step."""
    alive = visible & (evict_step >= step)
    e = exp_row * alive[:, :, None, :]
    z = mx.maximum(e.sum(axis=-1, keepdims=True), 1e-30)
    weights = (e / z).mean(axis=2)
    victim = lowest_weight(weights, positions, protected | ~alive)
    cols = mx.arange(evict_step.shape[-1])
    return mx.where(cols == victim[..., None], step, evict_step)


_decide_compiled = mx.compile(_decide)


def eviction_steps(
    logits: mx.array, n_retained: int, budget: int, positions: mx.array, n_sink: int
) -> mx.array:
    """Step at which each candidate is evicted (``L`` if it survives the chunk).

    logits: ``[B, G, H_d, L, n]`` probe logits over ``retained (n_retained) + chunk (L)``;
    positions: int32 ``[B, G, n]``. Returns int32 ``[B, G, n]``.
    """
    B, G, _, L, n = logits.shape
    cols = mx.arange(n)
    visible = cols[None, :] <= (mx.arange(L) + n_retained)[:, None]  # [L, n]
    # One stabilising max per row over what that row could see; alive is a subset of it.
    row_max = mx.where(visible, logits, -mx.inf).max(axis=-1, keepdims=True)
    exp_logits = exp(logits - row_max) * visible
    evict_step = mx.full((B, G, n), L, dtype=mx.int32)
    protected = positions < n_sink
    for i in range(max(0, budget - n_retained), L):
        evict_step = _decide_compiled(
            exp_logits[:, :, :, i, :],
            evict_step,
            mx.array(i, dtype=mx.int32),
            visible[i],
            protected,
            positions,
        )
    return evict_step


def alive_mask(evict_step: mx.array, n_retained: int, length: int) -> mx.array:
    """bool ``[B, G, L, n]``: candidate ``j`` is alive when query ``i`` attends."""
    n = evict_step.shape[-1]
    steps = mx.arange(length)[:, None]
    visible = mx.arange(n)[None, :] <= steps + n_retained
    return visible & (steps <= evict_step[:, :, None, :])
