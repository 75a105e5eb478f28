"""End to end through mlx-lm's generation loops, and bounded memory over long decodes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.generate import generate_step

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, TOVAKVCache


def _tova(cache):
    return [c for c in cache if isinstance(c, TOVAKVCache)]


@pytest.fixture
def sizes(monkeypatch):
    """Rows held by every TOVA cache right after each of its attention calls."""
    seen = []
    attend = TOVAKVCache.attend

    def record(cache, queries, scale, mask, sinks, **passed):
        out = attend(cache, queries, scale, mask, sinks, **passed)
        seen.append((cache.settings["budget"], cache.tova_state.n_kept))
        return out

    monkeypatch.setattr(TOVAKVCache, "attend", record)
    return seen


def _manual_greedy(model, cache, prompt, steps, prefill_step_size):
    """generate_step's schedule written out: prefill all but the last token in chunks, then
    one token per step, greedy."""
    n = prompt.size
    start = 0
    while n - start > 1:
        size = min(prefill_step_size, n - 1 - start)
        model(prompt[None, start : start + size], cache=cache)
        mx.eval([c.state for c in cache])
        start += size
    y, tokens, logprobs = prompt[None, start:], [], []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        lp = logits - mx.logsumexp(logits, keepdims=True)
        y = mx.argmax(lp, axis=-1)[:, None]
        tokens.append(y.item())
        logprobs.append(np.array(lp[0]))
    return tokens, logprobs


@pytest.mark.parametrize("method", ["tova", "tova_adapted"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_generate_step_runs_within_budget(tiny_model, h, sizes, arch, method):
    model = tiny_model(arch)
    budget = 12
    config = KVCacheConfig(method=method, tova_budget=budget, tova_n_sink=2)
    cache = KVCacheBuilder.for_model(model, config)
    prompt = h.random_tokens(40, seed=20)[0]
    tokens, logprobs = [], []
    for i, (token, lp) in enumerate(
        generate_step(prompt, model, prompt_cache=cache, max_tokens=25, prefill_step_size=16)
    ):
        tokens.append(token)
        logprobs.append(np.array(lp))
        for c in _tova(cache):
            assert c.size() <= budget and c.tova_state.n_kept <= budget
            assert c.offset in (40 + i, 40 + i + 1)  # one step is computed ahead
    assert len(tokens) == 25
    assert len(sizes) >= 25 * len(_tova(cache))
    assert all(n <= budget for budget, n in sizes)
    # Same tokens and log-probabilities as the loop written by hand.
    want_tokens, want_logprobs = _manual_greedy(
        model, KVCacheBuilder.for_model(model, config), prompt, 25, 16
    )
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(logprobs), np.stack(want_logprobs), atol=1e-5)


def test_generate_and_stream_generate_with_a_tokenizer(tiny_model, tiny_tokenizer, h, sizes):
    model = tiny_model("mistral")
    budget = 10
    config = KVCacheConfig(tova_budget=budget, tova_n_sink=2)
    words = [f"w{max(i, 2)}" for i in h.random_tokens(30, seed=21)[0].tolist()]  # 0, 1: special
    prompt = " ".join(words)
    assert tiny_tokenizer.encode(prompt) == [int(w[1:]) for w in words]

    cache = KVCacheBuilder.for_model(model, config)
    text = generate(model, tiny_tokenizer, prompt, prompt_cache=cache, max_tokens=12)
    assert isinstance(text, str)
    assert all(c.size() <= budget for c in cache)
    assert cache[0].offset >= 30

    cache = KVCacheBuilder.for_model(model, config)
    responses = []
    for response in stream_generate(
        model, tiny_tokenizer, prompt, prompt_cache=cache, max_tokens=12, prefill_step_size=7
    ):
        responses.append(response)
        assert all(c.size() <= budget for c in cache)
    assert responses[-1].prompt_tokens == 30
    assert 1 <= responses[-1].generation_tokens <= 12
    assert "".join(r.text for r in responses) == text  # same greedy continuation
    # The cache carries on into a second turn without growing.
    more = generate(model, tiny_tokenizer, "w3 w4 w5", prompt_cache=cache, max_tokens=5)
    assert isinstance(more, str) and all(c.size() <= budget for c in cache)
    assert sizes and all(n <= budget for _, n in sizes)


def test_long_decode_keeps_rows_bytes_and_memory_bounded(tiny_model, h):
    model = tiny_model("llama")
    budget = 32
    cache = KVCacheBuilder.for_model(model, KVCacheConfig(tova_budget=budget, tova_n_sink=4))
    prompt = h.random_tokens(8, seed=22)[0]
    full_bytes = None
    memory = {}
    for step, _ in enumerate(generate_step(prompt, model, prompt_cache=cache, max_tokens=2000)):
        if step >= budget:
            rows = [c.tova_state.n_kept for c in cache]
            nbytes = [c.nbytes for c in cache]
            assert rows == [budget] * len(cache)
            full_bytes = full_bytes or nbytes
            assert nbytes == full_bytes
            assert all(c.tova_state.slots.n_slots <= budget + 1 for c in cache)
        if step + 1 in (500, 1000, 1500, 2000):
            mx.synchronize()
            memory[step + 1] = mx.get_active_memory()
    assert cache[0].offset == 8 + 2000
    # 4 heads x (32 rows + the dead slot a decode step leaves) x 8 dims x fp32 x (k, v), per
    # layer: the bytes the cache holds, not only the kept rows
    assert full_bytes == [4 * (budget + 1) * 8 * 4 * 2] * 2
    slack = 256 * 1024
    assert max(memory.values()) - memory[500] < slack, memory
