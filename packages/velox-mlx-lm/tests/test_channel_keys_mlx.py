"""Keys quantized per channel (``kv_key_layout="channel"``) through mlx-lm: past the budget the
store stays bounded (groups, a window under a group, fewer than a group of dead rows) and
counts what it holds; batching, exact trims and prompt-cache files keep working; settings it
cannot serve are refused by name.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache
from test_batch_generate import alone, assert_same_as_alone, batched, config, prompts
from test_quantized_mlx import model_32, run

from velox_cache_core.store.channel_keys import KRows
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.prompt_cache import load_prompt_cache as velox_load

BITS, GROUP = 4, 32


def channel(method: str, budget: int = 8, bits: int = BITS) -> KVCacheConfig:
    return config(method, budget).replace(
        kv_bits=bits, kv_group_size=GROUP, kv_key_layout="channel"
    )


LONG = mx.array(np.random.default_rng(1).integers(0, 128, size=(1, 160)), dtype=mx.int32)


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm", "snapkv", "morphkv"])
def test_past_the_budget_keys_stay_grouped_and_bounded(method: str) -> None:
    """A 64-token prompt and 96 decode steps at budget 40: groups are formed and repacked,
    the rows kept are the plain cache's count, and the bytes are what the store holds."""
    model = model_32()
    cache = KVCacheBuilder.for_model(model, channel(method, budget=40))
    plain = KVCacheBuilder.for_model(model, config(method, budget=40))
    got = run(model, cache, LONG, [64, *[1] * 96])
    want = run(model, plain, LONG, [64, *[1] * 96])
    token = run(
        model,
        KVCacheBuilder.for_model(model, channel(method, 40).replace(kv_key_layout="token")),
        LONG,
        [64, *[1] * 96],
    )
    assert np.isfinite(got).all()
    # no further from the unquantized cache than keys quantized per token (this model's keys
    # have no outlier channel, where the per-channel layout gains most)
    assert np.abs(got - want).mean() <= np.abs(token - want).mean()
    for c, p in zip(cache, plain, strict=True):
        assert c.tokens_kept == p.tokens_kept
        slots = c.policy_state.slots
        store = slots.reserve if slots.n_held > slots.n_slots else slots
        keys = store.keys
        assert isinstance(keys, KRows) and keys.n_quantized >= GROUP  # groups were formed
        assert keys.n_physical - keys.shape[2] < GROUP and keys.window.shape[2] < GROUP
        held = sum(a.nbytes for a in store.keys.arrays() + store.values.arrays())
        assert c.nbytes == held


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_batched_rows_equal_sequences_alone(method: str) -> None:
    model = model_32()
    cfg = channel(method)
    items = [(p, 5) for p in prompts((21, 5, 13))]
    assert_same_as_alone(model, cfg, items, batched(model, cfg, items))


def test_trim_and_prompt_cache_files(tmp_path: Any) -> None:
    model = model_32()
    cfg = channel("tova", budget=16, bits=2)
    _, _, cache = alone(model, cfg, prompts((70,))[0], 6)
    assert all(isinstance(c.policy_state.slots.keys, KRows) for c in cache)
    path = str(tmp_path / "k.safetensors")
    save_prompt_cache(path, cache)
    loaded = velox_load(path, cfg)
    assert [c.quant for c in loaded] == [c.quant for c in cache]
    token = mx.array([[5]])
    np.testing.assert_array_equal(
        np.array(model(token, cache=loaded)), np.array(model(token, cache=cache))
    )
    before = np.array(model(mx.array([[9]]), cache=cache))
    for c in cache:
        c.trim(1)
    np.testing.assert_array_equal(np.array(model(mx.array([[9]]), cache=cache)), before)
    with pytest.raises(ValueError, match="kv_key_layout='channel'"):
        velox_load(path, cfg.replace(kv_key_layout="token"))


def test_settings_it_cannot_serve_are_refused() -> None:
    with pytest.raises(ValueError, match="kvzip_allocation='uniform'"):
        KVCacheConfig(method="kvzip", kv_bits=4, kv_key_layout="channel")
    with pytest.raises(ValueError, match="method='full' gives mlx-lm's QuantizedKVCache"):
        KVCacheConfig(method="full", kv_bits=4, kv_key_layout="channel")
    with pytest.raises(ValueError, match="give kv_bits"):
        KVCacheConfig(method="tova", kv_key_layout="channel")
    with pytest.raises(ValueError, match="kv_key_layout must be one of 'token', 'channel'"):
        KVCacheConfig(method="tova", kv_bits=4, kv_key_layout="rows")
    cfg = KVCacheConfig(
        method="kvzip", kvzip_allocation="uniform", kv_bits=2, kv_key_layout="channel"
    )
    assert cfg.quant is not None and cfg.quant.keys == "channel"


def test_flags() -> None:
    from velox_mlx_lm.cli import build_parser
    from velox_mlx_lm.flags import config_from_args
    from velox_mlx_lm.serve import build_parser as serve_parser

    for parser in (build_parser(), serve_parser()):
        args = parser.parse_args(
            ["--method", "tova", "--kv-bits", "2", "--kv-key-layout", "channel"]
        )
        assert config_from_args(args).kv_key_layout == "channel"
    args = build_parser().parse_args(
        ["--method", "full", "--kv-bits", "4", "--kv-key-layout", "channel"]
    )
    with pytest.raises(ValueError, match="--kv-key-layout"):
        config_from_args(args)
