"""velox-serve's prompt cache (``velox_mlx_lm.serve.cache``) on a tiny random llama: it trims a
stored Velox cache only within its undo log, keeps the prefixes it could not trim back to,
never leaves an empty prompt, and holds ``max_bytes`` with the bytes a cache really holds."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.serve.cache import VeloxPromptCache, cache_nbytes, trimmable_tokens

CONFIG = KVCacheConfig(method="tova", tova_budget=8, tova_n_sink=1)


def fed(model: Any, tokens: list[int], singles: int = 0) -> list[Any]:
    """Caches after ``tokens``: all but the last ``singles`` in one chunk, then one by one."""
    caches = KVCacheBuilder.for_model(model, CONFIG)
    head = len(tokens) - singles
    model(mx.array([tokens[:head]]), cache=caches)
    for t in tokens[head:]:
        model(mx.array([[t]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def test_reuse_is_exact_and_keeps_unreachable_prefixes(tiny_model: Any) -> None:
    model = tiny_model("llama")
    system = list(range(2, 32))  # 30 tokens
    first = system + list(range(40, 60)) + [61, 62]  # a finished request: 2 decode steps
    store = VeloxPromptCache(max_size=10)
    store.insert_cache("m", system, fed(model, system), cache_type="system")
    done = fed(model, first, singles=2)
    assert trimmable_tokens(done) == 2  # the 20-token chunk cleared the log (window 16)
    store.insert_cache("m", first, done)
    assert len(store) == 2  # the system prefix is kept: `first` cannot trim back to it

    # A new request sharing the system prompt starts from it, not from `first`.
    other = [*system, 70, 71, 72]
    cache, rest = store.fetch_nearest_cache("m", other)
    assert rest == [70, 71, 72] and cache[0].offset == len(system)

    # Within the undo log the longer entry is trimmed back exactly.
    near = [*first[:-1], 99]
    cache, rest = store.fetch_nearest_cache("m", near)
    assert rest == [99] and cache[0].offset == len(first) - 1
    alone = fed(model, first[:-1], singles=1)
    assert mx.array_equal(cache[0].positions, alone[0].positions)
    assert mx.array_equal(cache[0].keys, alone[0].keys)

    # An exact hit still leaves one token to feed.
    cache, rest = store.fetch_nearest_cache("m", system)
    assert rest == system[-1:] or cache is None


def test_bytes_are_true_and_max_bytes_holds(tiny_model: Any) -> None:
    model = tiny_model("llama")
    a = fed(model, list(range(2, 22)), singles=3)
    assert all(cache_nbytes(c) >= c.nbytes + c.undo_nbytes for c in a)
    one = sum(cache_nbytes(c) for c in a)
    store = VeloxPromptCache(max_size=10, max_bytes=one + one // 2)
    store.insert_cache("m", list(range(2, 22)), a)
    store.insert_cache("m", list(range(50, 70)), fed(model, list(range(50, 70)), singles=3))
    assert len(store) == 1 and 0 < store.nbytes <= store.max_bytes
