"""Pinned spans through mlx-lm: ``PolicyKVCache.pin``, ``velox_mlx_lm.pins.pin_span`` over a
model's caches, prompt files, speculative decoding, batched generation and
``velox-generate --pin-prefix``.

The core's own tests (velox-cache-core/tests/test_pins.py) check every policy against its
reference with a pinned span; these check that the span reaches every mlx-lm path and stays.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, PolicyKVCache
from velox_mlx_lm.pins import pin_prefix, pin_span, pinned_tokens, velox_layers

METHODS = ["tova", "tova_adapted", "h2o", "streaming_llm", "morphkv"]


def config(method: str, budget: int = 12) -> KVCacheConfig:
    policy = "tova" if method.startswith("tova") else method
    return KVCacheConfig(method=method, **{f"{policy}_budget": budget})


def kept(cache: PolicyKVCache) -> set[int]:
    positions = np.array(cache.positions)
    return set.intersection(*(set(row.tolist()) for row in positions[0]))


@pytest.mark.parametrize("method", METHODS)
def test_pinned_span_survives_prompt_and_decode(tiny_model: Any, h: Any, method: str) -> None:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, config(method, 16))
    assert pin_span(caches, 3, 7) == len(caches)
    tokens = h.random_tokens(50, seed=1)
    h.forward_chunks(model, caches, tokens, [20, 10, *([1] * 20)])
    for cache in velox_layers(caches):
        assert cache.size() <= 16
        assert {3, 4, 5, 6} <= kept(cache)
        assert cache.pinned_spans == [(3, 7)] and cache.pinned_tokens == 4
    assert pinned_tokens(caches) == 4


def test_pin_span_is_all_layers_or_none(tiny_model: Any, h: Any) -> None:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, config("tova"))
    h.forward_chunks(model, caches, h.random_tokens(30, seed=2), [30])
    layers = list(velox_layers(caches))
    evicted_in_last = sorted(set(range(30)) - kept(layers[-1]))[0]
    before = [c.pinned_spans for c in layers]
    with pytest.raises(ValueError, match="already evicted"):
        pin_span(caches, evicted_in_last, evicted_in_last + 1)
    assert [c.pinned_spans for c in layers] == before == [[] for _ in layers]
    with pytest.raises(ValueError, match="would not fit"):
        pin_span(caches, 100, 200)


@pytest.mark.parametrize("method", ["tova", "h2o", "snapkv"])
def test_pins_go_through_prompt_files(tiny_model: Any, h: Any, tmp_path: Any, method: str) -> None:
    model = tiny_model("llama")
    cfg = config(method, 24)
    if method == "snapkv":  # the default window would take the whole budget
        cfg = KVCacheConfig(method="snapkv", snapkv_budget=24, snapkv_window=8)
    caches = pin_prefix(KVCacheBuilder.for_model(model, cfg), 5)
    h.forward_chunks(model, caches, h.random_tokens(60, seed=3), [40, 20])
    path = str(tmp_path / "pins.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(velox_layers(caches), velox_layers(loaded), strict=True):
        assert b.pinned_spans == a.pinned_spans == [(0, 5)]
    token = mx.array([[7]])
    for _ in range(8):  # decoding on, both keep the span and agree
        x, y = model(token, cache=caches), model(token, cache=loaded)
        np.testing.assert_array_equal(np.array(x), np.array(y))
        token = mx.argmax(x[:, -1], axis=-1)[:, None]
    for cache in velox_layers(loaded):
        assert set(range(5)) <= kept(cache)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_speculative_with_pins_equals_plain(embedded_model_path: Any, method: str) -> None:
    from velox_mlx_lm.embedded import draft_of, load_default

    model, tokenizer = load_default()
    draft = draft_of(model, 4)
    prompt = mx.array(tokenizer.encode("The Roman Empire grew out of the Roman Republic. " * 6))
    plain_caches = pin_prefix(KVCacheBuilder.for_model(model, config(method, 32)), 8)
    plain = [
        int(t) for t, _ in generate_step(prompt, model, prompt_cache=plain_caches, max_tokens=16)
    ]
    caches = pin_prefix(KVCacheBuilder.for_model(model, config(method, 32)), 8)
    drafted = pin_prefix(KVCacheBuilder.for_model(draft, config(method, 32)), 8)
    rounds = speculative_generate_step(
        prompt, model, draft, prompt_cache=caches + drafted, max_tokens=16, num_draft_tokens=3
    )
    assert [int(t) for t, _, _ in rounds] == plain
    for cache in velox_layers(caches + drafted):
        assert set(range(8)) <= kept(cache)


@pytest.mark.model
@pytest.mark.slow
def test_generate_pin_prefix(embedded_model_path: Any, capsys: Any) -> None:
    from velox_mlx_lm.cli.app import main

    prompt = "Remember the code word HERON. " + "The river runs past the mill. " * 20
    argv = ["--prompt", prompt, "--method", "tova", "--budget", "32", "--max-tokens", "4"]
    assert main([*argv, "--pin-prefix", "8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["runs"][0]
    assert stats["pinned_tokens"] == 8
    with pytest.raises(SystemExit):
        main([*argv, "--pin-prefix", "-1"])
    assert main([*argv, "--pin-prefix", "100000"]) == 1
    assert "longer than the prompt" in capsys.readouterr().err


@pytest.mark.parametrize("allocation", ["uniform", "head"])
def test_kvzip_pass_keeps_the_pinned_span(
    tiny_model: Any, tiny_tokenizer: Any, allocation: str
) -> None:
    """KVzip's model-driven pass (``velox_mlx_lm.kvzip.compress``) scores the context by its
    reconstruction and cuts it to the budget: a span pinned before the prefill survives the cut
    in every layer and head, and the same pass without the pin drops part of it (the test of
    the test)."""
    from velox_cache_core.policies.kvzip import PAD
    from velox_mlx_lm.kvzip import compress, prefill

    model = tiny_model("llama")
    tokens = np.random.default_rng(3).integers(2, 128, size=40).tolist()
    span = set(range(20, 24))

    def run(pinned: bool) -> list[set[int]]:
        settings = {"kvzip_budget": 10, "kvzip_n_sink": 2, "kvzip_allocation": allocation}
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", **settings))
        if pinned:
            pin_span(caches, 20, 24)
        prefill(model, caches, tokens, step=16)
        compress(model, tiny_tokenizer, caches, tokens, chunk_size=16)
        heads = []
        for cache in velox_layers(caches):
            for row in np.array(cache.positions)[0]:
                heads.append({int(p) for p in row if p != PAD})
        return heads

    assert all(span <= head for head in run(pinned=True))
    assert not all(span <= head for head in run(pinned=False))


@pytest.mark.parametrize("method", ["tova", "h2o"])
def test_pins_cost_no_bytes_beyond_the_budget(tiny_model: Any, h: Any, method: str) -> None:
    """Pinned rows count in the budget: over 1,000 decode steps a pinned cache holds the same
    bytes as an unpinned one at the same budget, keeps the span, and MLX's active memory does
    not grow past a fixed slack once it is steady."""
    model = tiny_model("llama")
    prompt = h.random_tokens(12, seed=5)[0]

    def run(pinned: bool) -> tuple[list[int], dict[int, int], list[PolicyKVCache]]:
        caches = KVCacheBuilder.for_model(model, config(method, 32))
        if pinned:
            pin_span(caches, 2, 10)
        memory: dict[int, int] = {}
        steps = generate_step(prompt, model, prompt_cache=caches, max_tokens=1000)
        for step, _ in enumerate(steps):
            if step + 1 in (400, 700, 1000):
                mx.synchronize()
                memory[step + 1] = mx.get_active_memory()
        return [c.nbytes for c in caches], memory, caches

    plain_bytes, _, _ = run(pinned=False)
    pinned_bytes, memory, caches = run(pinned=True)
    assert pinned_bytes == plain_bytes
    assert all(set(range(2, 10)) <= kept(c) for c in caches)
    assert pinned_tokens(caches) == 8
    assert max(memory.values()) - memory[400] < 256 * 1024, memory
