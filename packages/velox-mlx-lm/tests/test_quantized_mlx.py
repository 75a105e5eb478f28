"""Quantized rows (``KVCacheConfig(kv_bits=...)``) through mlx-lm: within the budget every
method gives mlx-lm's ``QuantizedKVCache`` logits; past it the cache stays at its budget and
holds quantized bytes; batching, speculative trims, prompt-cache files and the hook-less path
keep working; models the hook cannot reach are refused.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import QuantizedKVCache, save_prompt_cache
from test_batch_generate import alone, assert_same_as_alone, batched, config, prompts

from velox_cache_core.store.token_rows import QRows
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, methods
from velox_mlx_lm.cache import PolicyKVCache, cache_class
from velox_mlx_lm.prompt_cache import load_prompt_cache as velox_load

METHODS = tuple(m for m in methods() if m != "full")
BITS, GROUP = 4, 32


def model_32(seed: int = 0) -> Any:
    """A tiny GQA llama with head_dim 32 (a group of 32 features divides it)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        vocab_size=128,
    )
    model = llama.Model(args)
    for layer in model.layers:  # peaked attention: no near-tie decisions
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 3
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * 3
    mx.eval(model.parameters())
    return model


def quantized(method: str, budget: int = 8) -> KVCacheConfig:
    return config(method, budget).replace(kv_bits=BITS, kv_group_size=GROUP)


def run(model: Any, cache: list[Any], tokens: mx.array, chunks: list[int]) -> np.ndarray:
    out, start = [], 0
    for size in chunks:
        logits = model(tokens[:, start : start + size], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        out.append(np.array(logits[0]))
        start += size
    return np.concatenate(out)


TOKENS = mx.array(np.random.default_rng(0).integers(0, 128, size=(1, 24)), dtype=mx.int32)


@pytest.mark.parametrize("method", METHODS)
def test_within_budget_equals_quantized_kvcache(method: str) -> None:
    model = model_32()
    chunks = [7, 5, 1, 1, 1, 9]
    want = run(model, [QuantizedKVCache(GROUP, BITS) for _ in model.layers], TOKENS, chunks)
    cache = KVCacheBuilder.for_model(model, quantized(method, budget=64))
    got = run(model, cache, TOKENS, chunks)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert all(isinstance(c.policy_state.slots.keys, QRows) for c in cache)


@pytest.mark.parametrize("method", METHODS)
def test_past_the_budget_rows_stay_quantized_and_bounded(method: str) -> None:
    model = model_32()
    cfg = quantized(method)
    cache = KVCacheBuilder.for_model(model, cfg)
    run(model, cache, TOKENS, [16, *[1] * 8])
    plain = KVCacheBuilder.for_model(model, config(method))
    run(model, plain, TOKENS, [16, *[1] * 8])
    for c, p in zip(cache, plain, strict=True):
        assert c.bits == BITS and c.group_size == GROUP
        assert c.tokens_kept == p.tokens_kept
        slots = c.policy_state.slots
        store = slots.reserve if slots.n_held > slots.n_slots else slots  # growing: reserve
        held = sum(a.nbytes for a in store.keys.arrays() + store.values.arrays())
        assert c.nbytes == held
        # 4 bits plus a float32 scale and bias per 32 features, against 32 bits
        assert c.nbytes / p.nbytes == pytest.approx((BITS + 64 / GROUP) / 32, rel=0.02)


def test_full_method_gives_mlx_lms_quantized_cache() -> None:
    model = model_32()
    cfg = KVCacheConfig(method="full", kv_bits=8, kv_group_size=32)
    cache = KVCacheBuilder.for_model(model, cfg)
    assert all(type(c) is QuantizedKVCache and c.bits == 8 and c.group_size == 32 for c in cache)


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_batched_rows_equal_sequences_alone(method: str) -> None:
    model = model_32()
    cfg = quantized(method)
    items = [(p, 5) for p in prompts((21, 5, 13))]
    assert_same_as_alone(model, cfg, items, batched(model, cfg, items))


def test_trim_and_prompt_cache_files(tmp_path: Any) -> None:
    model = model_32()
    cfg = quantized("tova")
    _, _, cache = alone(model, cfg, prompts((20,))[0], 4)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, cache)
    loaded = velox_load(path, cfg)
    assert [c.quant for c in loaded] == [c.quant for c in cache]
    token = mx.array([[5]])
    np.testing.assert_array_equal(
        np.array(model(token, cache=loaded)), np.array(model(token, cache=cache))
    )
    # an exact trim over quantized rows, then the same token again gives the same logits
    before = np.array(model(mx.array([[9]]), cache=cache))
    for c in cache:
        c.trim(1)
    np.testing.assert_array_equal(np.array(model(mx.array([[9]]), cache=cache)), before)
    with pytest.raises(ValueError, match="saved with kv_bits=4"):
        velox_load(path, cfg.replace(kv_bits=8))
    with pytest.raises(ValueError, match="saved with kv_bits=4"):
        velox_load(path, config("tova"))
    other = cache_class("tova")(budget=8, n_sink=1, quant=None)
    with pytest.raises(ValueError, match="quantized to 4 bits"):
        other.state = loaded[0].state


def test_without_the_hook_mlx_lm_runs_its_quantized_attention() -> None:
    """A cache made directly and used by a model without the hook: ``update_and_fetch``
    returns mlx-lm's quantized tuples and ``bits``, so mlx-lm's quantized SDPA runs over the
    retained rows (StreamingLLM needs no queries: the same decisions either way)."""
    hooked = model_32()
    cache = KVCacheBuilder.for_model(hooked, quantized("streaming_llm"))
    want = run(hooked, cache, TOKENS, [1] * 14)
    bare = model_32()  # a new model: the hook is installed per model source module, so
    cls = cache_class("streaming_llm")  # compare against a cache the hook does not see
    direct = [cls(budget=8, n_sink=1, quant=quantized("streaming_llm").quant) for _ in range(2)]
    fetched = direct[0].update_and_fetch(mx.zeros((1, 2, 1, 32)), mx.zeros((1, 2, 1, 32)))
    assert isinstance(fetched[0], tuple) and len(fetched[0]) == 3
    assert fetched[0][0].dtype == mx.uint32
    direct[0].trim(1)
    np.testing.assert_allclose(run(bare, direct, TOKENS, [1] * 14), want, atol=1e-4)
    plain = cache_class("tova")(budget=8)
    assert not hasattr(plain, "bits")


def test_bad_settings_fail_at_configuration() -> None:
    with pytest.raises(ValueError, match="kv_bits must be one of 1, 2, 3, 4, 5, 6, 8, got 7"):
        KVCacheConfig(method="tova", kv_bits=7)
    with pytest.raises(ValueError, match="kv_group_size must be one of 32, 64, 128, got 16"):
        KVCacheConfig(method="tova", kv_bits=4, kv_group_size=16)
    model = model_32()
    with pytest.raises(ValueError, match="kv_group_size=64 must divide the model's head_dim=32"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", kv_bits=4))


def test_a_model_that_attends_by_hand_is_refused() -> None:
    from model_zoo import build

    model = build("gemma2", overrides={"head_dim": 32})
    with pytest.raises(ValueError, match="gemma2 computes attention by hand"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", kv_bits=8, kv_group_size=32))


def test_caches_hold_velox_classes() -> None:
    cache = KVCacheBuilder.for_model(model_32(), quantized("h2o"))
    assert all(isinstance(c, PolicyKVCache) for c in cache)


def test_serve_flags_quantize_velox_rows_and_keep_batching() -> None:
    from velox_mlx_lm.serve import app as serve

    args = serve.build_parser().parse_args(["--method", "tova", "--kv-bits", "4"])
    cfg = serve._check_args(args)
    assert (cfg.kv_bits, cfg.kv_group_size) == (4, 64)
    assert args.kv_bits is None  # mlx-lm's server neither quantizes again nor stops batching
    args = serve.build_parser().parse_args(
        ["--method", "h2o", "--kv-bits", "8", "--kv-group-size", "32"]
    )
    assert serve._check_args(args).quant.group_size == 32
    # --method full keeps mlx-lm's meaning: its own flags, its own delayed start
    args = serve.build_parser().parse_args(["--method", "full", "--kv-bits", "4"])
    cfg = serve._check_args(args)
    assert cfg.kv_bits is None and args.kv_bits == 4
    assert args.quantized_kv_start == serve.mlx_server.DEFAULT_QUANTIZED_KV_START
    args = serve.build_parser().parse_args(["--method", "tova", "--kv-bits", "4"])
    args.quantized_kv_start = 100
    with pytest.raises(ValueError, match="--quantized-kv-start 100"):
        serve._check_args(args)
    args = serve.build_parser().parse_args(["--method", "tova", "--kv-bits", "7"])
    with pytest.raises(ValueError, match="--kv-bits must be one of"):
        serve._check_args(args)


def test_generate_flags() -> None:
    from velox_mlx_lm.cli import app as cli

    args = cli.build_parser().parse_args(["--demo", "--method", "full", "--kv-bits", "8"])
    assert cli._check_args(args).kv_bits == 8
    args = cli.build_parser().parse_args(["--demo", "--kv-bits", "4", "--quantized-kv-start", "9"])
    with pytest.raises(ValueError, match="only 0 is accepted"):
        cli._check_args(args)
    args = cli.build_parser().parse_args(["--demo", "--kv-bits", "4", "--kv-group-size", "16"])
    with pytest.raises(ValueError, match="--kv-group-size must be one of 32, 64, 128"):
        cli._check_args(args)


def test_kvzip_reconstruction_pass_over_quantized_rows(tiny_tokenizer: Any) -> None:
    """KVzip's scoring pass attends its reconstruction chunks at full precision over the
    quantized context (never storing them), then cuts the quantized rows to the budget."""
    from velox_mlx_lm.kvzip import compress

    model = model_32()
    tokens = np.random.default_rng(4).integers(2, 128, size=40).tolist()
    cfg = KVCacheConfig(
        method="kvzip", kvzip_budget=12, kvzip_n_sink=1, kv_bits=BITS, kv_group_size=GROUP
    )
    caches = KVCacheBuilder.for_model(model, cfg)
    run(model, caches, mx.array(tokens)[None], [16, 16, 8])
    info = compress(model, tiny_tokenizer, caches, tokens, chunk_size=16)
    assert info["scored_tokens"] > 0
    for c in caches:
        assert c.size() <= 12 * 2  # the global allocation keeps 12 rows per head on average
        assert isinstance(c.policy_state.slots.keys, QRows)
    assert np.isfinite(run(model, caches, mx.array([[5, 6]]), [1, 1])).all()
