"""Pinned spans over a model's cache list: ``pin_span(cache, start, stop)`` pins every layer.

A span ``[start, stop)`` of token indices (0 = the sequence's first token) is never evicted by
any Velox layer (``PolicyKVCache.pin``; ``velox_cache_core.pins`` says what fits). Layers that
keep mlx-lm's own caches evict nothing (``KVCache``) or keep a sliding window by design
(Gemma 3's local layers' ``RotatingKVCache``): a pin leaves them as they are. All layers or
none: when one layer refuses the span, the layers pinned before it are put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlx_lm.models.cache import CacheList

from velox_mlx_lm.cache import PolicyKVCache


def velox_layers(caches: list[Any]) -> Iterator[PolicyKVCache]:
    """The Velox caches of a model's cache list (inside ``CacheList`` entries too)."""
    for cache in caches:
        members = cache.caches if type(cache) is CacheList else [cache]
        yield from (m for m in members if isinstance(m, PolicyKVCache))


def pin_span(caches: list[Any], start: int, stop: int) -> int:
    """Pin tokens ``[start, stop)`` in every Velox layer of ``caches``; returns how many layers
    took it. ``ValueError``/``TypeError`` from the first layer that refuses it, every layer
    then as it was."""
    done: list[tuple[PolicyKVCache, Any]] = []
    try:
        for cache in velox_layers(caches):
            before = cache.policy_state
            cache.pin(start, stop)
            done.append((cache, before))
    except (ValueError, TypeError):
        for cache, before in done:
            cache.layer.restore(before, cache.layer.log)
        raise
    return len(done)


def pin_prefix(caches: list[Any], n: int) -> list[Any]:
    """``caches`` with their sequence's first ``n`` tokens pinned (``n = 0``: as they are);
    ``velox-generate --pin-prefix N``."""
    if n:
        pin_span(caches, 0, n)
    return caches


def pinned_tokens(caches: list[Any]) -> int:
    """Pinned tokens seen so far, the most of any Velox layer (0 without one)."""
    return max((c.pinned_tokens for c in velox_layers(caches)), default=0)
