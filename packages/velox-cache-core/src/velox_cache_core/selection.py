"""Choosing which candidates to evict from their weights.

Ties are broken towards the oldest token: among equal lowest weights the lowest position goes.
Sinks (positions ``< n_sink``) and pinned spans (:mod:`velox_cache_core.pins`) are never chosen.
"""

from __future__ import annotations

import mlx.core as mx

# beyond every real position: what a row out of the running takes when ties break by age
NO_POSITION = 2**31 - 1


def lowest_weight(weights: mx.array, positions: mx.array, excluded: mx.array) -> mx.array:
    """Index of the candidate to evict in every row.

    weights: float ``[..., n]``; positions: int ``[..., n]`` (distinct within a row);
    excluded: bool ``[..., n]``, True where a candidate may not be evicted (sink, dead, unseen).
    Returns int32 ``[...]``.
    """
    w = mx.where(excluded, mx.inf, weights)
    tied = w == w.min(axis=-1, keepdims=True)
    oldest = mx.where(tied, positions, NO_POSITION)
    return mx.argmin(oldest, axis=-1).astype(mx.int32)


def highest_weights(
    weights: mx.array, positions: mx.array, protected: mx.array, n_keep: int
) -> mx.array:
    """Indices (ascending) of the ``n_keep`` candidates to keep in every row.

    Protected candidates are kept first; the rest by weight, ties lost by the oldest.
    weights: float ``[..., n]``; positions: int ``[..., n]``; protected: bool ``[..., n]``.
    Returns int32 ``[..., n_keep]``.
    """
    by_age = mx.argsort(positions, axis=-1)
    w = mx.take_along_axis(mx.where(protected, mx.inf, weights), by_age, axis=-1)
    # Stable sort: among equal weights the older candidate comes first and is evicted first.
    order = mx.argsort(w, axis=-1)
    n = weights.shape[-1]
    kept = mx.take_along_axis(by_age, order[..., n - n_keep :], axis=-1)
    return mx.sort(kept, axis=-1).astype(mx.int32)


def sinks(positions: mx.array, n_sink: int, pins: mx.array | None = None) -> mx.array:
    """bool, the shape of ``positions``: True where a position is never evicted, an attention
    sink (``< n_sink``) or inside one of the sequence's pinned spans.

    positions: int ``[B, ...]`` (batch first; token indices); pins: int32 ``[B, P, 2]``
    ``[start, stop)`` spans per sequence (empty spans ``[0, 0)`` pin nothing), or ``None``.
    """
    out = positions < n_sink
    if pins is None:
        return out
    return out | pinned(positions, pins)


def pinned(positions: mx.array, pins: mx.array) -> mx.array:
    """bool, the shape of ``positions`` (int ``[B, ...]``): inside a span of ``pins``
    (int32 ``[B, P, 2]``, or ``[1, P, 2]`` shared by every row)."""
    if positions.ndim < 2:
        raise ValueError(f"positions must be batch first [B, ...], got shape {positions.shape}")
    shape = (pins.shape[0],) + (1,) * (positions.ndim - 1) + (pins.shape[1],)
    start, stop = pins[..., 0].reshape(shape), pins[..., 1].reshape(shape)
    p = positions[..., None]
    return ((p >= start) & (p < stop)).any(axis=-1)
