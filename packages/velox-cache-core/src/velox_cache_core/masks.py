"""Attention masks over ``retained + chunk`` candidates."""

from __future__ import annotations

import mlx.core as mx


def chunk_causal(n_retained: int, length: int) -> mx.array:
    """bool ``[L, n]``: query ``i`` of a chunk sees every retained key and chunk keys ``<= i``.

    Candidates are ordered ``retained (n_retained) + chunk (L)``, so this is the causal mask
    aligned bottom-right.
    """
    n = n_retained + length
    return mx.arange(n)[None, :] <= (mx.arange(length) + n_retained)[:, None]


def expand_heads(mask: mx.array, batch: int, heads: int) -> mx.array:
    """Broadcast or repeat a ``[B?, G, L, n]``/``[L, n]`` mask to ``[B, heads, L, n]``.

    A mask with one group per KV head is repeated over each query group (``heads`` a multiple).
    """
    if mask.ndim == 2:
        mask = mask[None, None]
    groups = mask.shape[1]
    if groups not in (1, heads):
        mask = mx.repeat(mask, heads // groups, axis=1)
    return mx.broadcast_to(mask, (batch, heads, *mask.shape[2:]))
