"""Logits with a TOVA cache: equal to mlx-lm's KVCache below budget, and independent of how the
prompt is chunked once tokens are evicted (sequential prefill)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, TOVAKVCache

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
CHUNKINGS = {"1": 1, "7": 7, "64": 64, "whole": None}
N = 70  # prompt length; budget == N is the tightest budget that evicts nothing


@pytest.fixture(scope="module")
def reference(tiny_model, h):
    """Logits with mlx-lm's own caches and the same chunking: ``reference(arch, chunking)``."""
    tokens = h.random_tokens(N, seed=1)
    memo = {}

    def get(arch, chunking):
        if (arch, chunking) not in memo:
            model = tiny_model(arch)
            chunks = h.split(N, CHUNKINGS[chunking])
            memo[arch, chunking] = np.array(
                h.forward_chunks(model, h.plain_cache(model), tokens, chunks)
            )
        return memo[arch, chunking]

    return tokens, get


def _check_equal(got, want):
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("method", ["tova", "tova_adapted"])
@pytest.mark.parametrize("arch", ARCHS)
def test_within_budget_equals_kvcache(tiny_model, h, reference, arch, method, chunking):
    tokens, want = reference
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, tova_budget=N))
    assert any(isinstance(c, TOVAKVCache) for c in cache)
    got = h.forward_chunks(model, cache, tokens, h.split(N, CHUNKINGS[chunking]))
    _check_equal(got, want(arch, chunking))
    for c in cache:
        if isinstance(c, TOVAKVCache):
            assert c.offset == N and c.size() == N and c.compression_ratio == 1.0


COMBOS = list(itertools.product(["query", "key"], ["layer", "head"], ["sequential", "oneshot"]))


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize(("signal", "scope", "prefill"), COMBOS)
def test_within_budget_every_setting_on_llama(
    tiny_model, h, reference, signal, scope, prefill, chunking
):
    tokens, want = reference
    model = tiny_model("llama")
    config = KVCacheConfig(
        tova_budget=N, tova_signal=signal, tova_scope=scope, tova_prefill=prefill
    )
    cache = KVCacheBuilder.for_model(model, config)
    assert cache[0].settings == {
        "budget": N,
        "n_sink": 4,
        "signal": signal,
        "scope": scope,
        "prefill": prefill,
        "allocation": "uniform",
        "allocation_floor": 0.2,
    }
    got = h.forward_chunks(model, cache, tokens, h.split(N, CHUNKINGS[chunking]))
    _check_equal(got, want("llama", chunking))


SEQ_N = 60
SEQ_CHUNKINGS = {
    "whole": None,
    "ones": 1,
    "sevens": 7,
    "random": [5, 1, 13, 2, 9, 1, 1, 20, 8],
}


@pytest.fixture(scope="module")
def token_by_token(tiny_model, h):
    """Logits and survivors when the prompt is fed one token at a time (the definition)."""
    memo = {}

    def get(arch, config):
        key = (arch, config)
        if key not in memo:
            model = tiny_model(arch)
            cache = KVCacheBuilder.for_model(model, config)
            logits = h.forward_chunks(model, cache, h.random_tokens(SEQ_N, seed=2), [1] * SEQ_N)
            memo[key] = (np.array(logits), _survivors(cache))
        return memo[key]

    return get


def _survivors(cache):
    return [
        [sorted(row) for row in np.array(c.positions).reshape(-1, c.size()).tolist()]
        for c in cache
        if isinstance(c, TOVAKVCache)
    ]


SEQ_CONFIGS = [
    ("llama", KVCacheConfig(method="tova", tova_budget=12, tova_n_sink=2)),
    ("llama", KVCacheConfig(method="tova", tova_budget=12, tova_n_sink=2, tova_scope="head")),
    ("llama", KVCacheConfig(method="tova_adapted", tova_budget=12, tova_n_sink=2)),
    ("llama", KVCacheConfig(method="tova_adapted", tova_budget=12, tova_scope="layer")),
    ("mistral", KVCacheConfig(method="tova", tova_budget=16, tova_n_sink=4, tova_scope="head")),
    ("mistral", KVCacheConfig(method="tova_adapted", tova_budget=16, tova_n_sink=0)),
    ("qwen3", KVCacheConfig(method="tova", tova_budget=10, tova_n_sink=1)),
    ("gemma3", KVCacheConfig(method="tova", tova_budget=12, tova_n_sink=2)),
]


@pytest.mark.parametrize("chunking", SEQ_CHUNKINGS)
@pytest.mark.parametrize(
    ("arch", "config"), SEQ_CONFIGS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(SEQ_CONFIGS)]
)
def test_sequential_prefill_does_not_depend_on_chunking(
    tiny_model, h, token_by_token, arch, config, chunking
):
    want_logits, want_survivors = token_by_token(arch, config)
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, config)
    tokens = h.random_tokens(SEQ_N, seed=2)
    got = h.forward_chunks(model, cache, tokens, h.split(SEQ_N, SEQ_CHUNKINGS[chunking]))
    for c in cache:
        if isinstance(c, TOVAKVCache):
            assert c.offset == SEQ_N and c.size() == config.value("tova_budget")
    assert _survivors(cache) == want_survivors
    # Same kept tokens exactly; logits within float32 rounding. OpenBLAS sums a chunk's matmuls
    # in another order than token-by-token calls (seen: 1.2e-4 on one logit of gemma3's 7680).
    np.testing.assert_allclose(np.array(got), want_logits, rtol=1e-4, atol=3e-4)


def test_eviction_changes_logits(tiny_model, h):
    """Guard for the tests above: with a small budget the logits really differ from full."""
    model = tiny_model("llama")
    tokens = h.random_tokens(SEQ_N, seed=2)
    full = h.forward_chunks(model, h.plain_cache(model), tokens, [SEQ_N])
    cache = KVCacheBuilder.for_model(model, KVCacheConfig(tova_budget=12, tova_n_sink=2))
    tova = h.forward_chunks(model, cache, tokens, [SEQ_N])
    assert not np.allclose(np.array(full[-1]), np.array(tova[-1]), atol=1e-3)
    assert mx.all(cache[0].positions < SEQ_N).item()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["tova", "tova_adapted", "h2o", "morphkv"])
def test_long_chunk_equals_small_chunks(tiny_model, h, method):
    """mlx-lm feeds 2048-token chunks; a sequential-mode cache splits a long chunk internally
    (SUBCHUNK queries at a time), which must not change anything: one 4096-token chunk and
    256-token chunks leave the same state and give the same last logits."""
    import velox_cache_core.in_flight as vcache

    model = tiny_model("llama")
    policy = "tova" if method.startswith("tova") else method
    config = KVCacheConfig(method=method, **{f"{policy}_budget": 64})
    tokens = h.random_tokens(4097, seed=8)
    assert tokens.shape[1] - 1 > vcache.SUBCHUNK
    one = KVCacheBuilder.for_model(model, config)
    small = KVCacheBuilder.for_model(model, config)
    a = h.forward_chunks(model, one, tokens, [4096, 1])
    b = h.forward_chunks(model, small, tokens, [256] * 16 + [1])
    np.testing.assert_allclose(np.array(a[-1]), np.array(b[-1]), rtol=1e-4, atol=1e-4)
    for x, y in zip(one, small, strict=True):
        assert x.offset == y.offset == 4097
        assert np.array_equal(np.sort(np.array(x.positions)), np.sort(np.array(y.positions)))
