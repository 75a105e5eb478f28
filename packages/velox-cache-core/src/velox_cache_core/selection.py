"""Choosing which candidates to evict from their weights.

Ties are broken towards the oldest token: among equal lowest weights the lowest position goes.
Sinks (positions ``< n_sink``) are never chosen.
"""

from __future__ import annotations

import mlx.core as mx

_NO_POSITION = 2**31 - 1


def lowest_weight(weights: mx.array, positions: mx.array, excluded: mx.array) -> mx.array:
    """Index of the candidate to evict in every row.

    weights: float ``[..., n]``; positions: int ``[..., n]`` (distinct within a row);
    excluded: bool ``[..., n]``, True where a candidate may not be evicted (sink, dead, unseen).
    Returns int32 ``[...]``.
    """
    w = mx.where(excluded, mx.inf, weights)
    tied = w == w.min(axis=-1, keepdims=True)
    oldest = mx.where(tied, positions, _NO_POSITION)
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


def sinks(positions: mx.array, n_sink: int) -> mx.array:
    """bool ``[...]``: True where a position is an attention sink (never evicted)."""
    return positions < n_sink
