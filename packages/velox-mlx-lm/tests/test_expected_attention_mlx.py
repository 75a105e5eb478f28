"""Expected Attention on mlx-lm models: the builder hands each layer's cache the model's RoPE,
the hook's queries drive the cut and the decode evictions, and without the hook (no true
queries) the cache refuses instead of guessing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, KVCacheFactory
from velox_mlx_lm.builder import ROPE_SETTINGS


def _rope(cache) -> dict:
    return {s: cache.settings[s] for s in ROPE_SETTINGS}


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gemma3"])
def test_builder_hands_each_layer_the_models_rope(tiny_model, arch: str) -> None:
    model = tiny_model(arch)
    config = KVCacheConfig(method="expected_attention", expected_attention_budget=16)
    caches = KVCacheBuilder.for_model(model, config)
    ours = [(i, c) for i, c in enumerate(caches) if hasattr(c, "policy_name")]
    assert ours
    for i, cache in ours:
        rope = model.layers[i].self_attn.rope
        assert isinstance(rope, nn.RoPE)
        assert _rope(cache) == {
            "rope_base": float(rope.base),
            "rope_dims": rope.dims,
            "rope_traditional": rope.traditional,
            "rope_scale": float(rope.scale),
        }
    if arch == "gemma3":  # only the global layer is ours; its base is rope_theta, not the local
        assert [i for i, _ in ours] == [2] and ours[0][1].settings["rope_base"] == 1e6


def test_rope_given_in_the_config_is_kept(tiny_model) -> None:
    config = KVCacheConfig(
        method="expected_attention",
        expected_attention_rope_base=5e5,
        expected_attention_rope_traditional=True,
    )
    caches = KVCacheBuilder.for_model(tiny_model("mistral"), config)
    assert all(c.settings["rope_base"] == 5e5 and c.settings["rope_traditional"] for c in caches)


def test_a_rope_it_cannot_read_is_refused() -> None:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=128,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
    )
    model = llama.Model(args)
    with pytest.raises(ValueError, match=r"Llama3RoPE.*expected_attention_rope_base"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="expected_attention"))
    # Other methods do not read the RoPE.
    KVCacheBuilder.for_model(model, KVCacheConfig(method="tova"))


def test_generation_cuts_at_the_prompt_end_then_holds_the_budget(tiny_model, h) -> None:
    model = tiny_model("mistral")
    config = KVCacheConfig(
        method="expected_attention",
        expected_attention_budget=12,
        expected_attention_n_sink=2,
        expected_attention_n_queries=8,
        expected_attention_refresh_every=5,
    )
    caches = KVCacheBuilder.for_model(model, config)
    tokens = h.random_tokens(60, seed=3)
    mx.eval(model(tokens[:, :39], cache=caches))
    assert all(c.size() == 39 for c in caches)  # the prompt is whole until its last token
    for t in range(39, 60):
        logits = model(tokens[:, t : t + 1], cache=caches)
        mx.eval(logits)
        assert mx.all(mx.isfinite(logits)).item()
        assert all(c.size() == 12 and c.offset == t + 1 for c in caches)
    for cache in caches:
        state = cache.policy_state
        assert state.compressed and state.steps == (60 - 40) % 5
        kept = np.array(state.positions)
        assert (kept[..., :, None] == np.arange(2)).any(axis=-2).all()  # the sinks stay
        # the query window holds the last n_queries positions, un-rotated from the hook's
        assert np.array(state.queries.positions).tolist() == list(range(52, 60))


def test_the_window_holds_the_models_unrotated_queries(tiny_model, h, monkeypatch) -> None:
    """What the statistics are taken from: the hook's queries, rotated back."""
    import velox_mlx_lm.hook as hook

    model = tiny_model("mistral")
    seen = []
    original = hook.velox_scaled_dot_product_attention

    def spy(queries, keys, values, cache, scale, mask, sinks=None):
        seen.append((queries, cache.offset - queries.shape[2]))
        return original(queries, keys, values, cache, scale, mask, sinks)

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="expected_attention"))
    module = type(model.layers[0].self_attn).__call__.__globals__
    monkeypatch.setitem(module, "scaled_dot_product_attention", spy)
    mx.eval(model(h.random_tokens(10, seed=4), cache=caches))
    queries, start = seen[0]
    rope = model.layers[0].self_attn.rope
    window = caches[0].policy_state.queries
    rotated = mx.fast.rope(
        window.probes, rope.dims, traditional=rope.traditional, base=rope.base, scale=1.0, offset=0
    )
    assert start == 0 and np.array(window.positions).tolist() == list(range(10))
    np.testing.assert_allclose(np.array(rotated), np.array(queries), atol=1e-4)


def test_prompt_cache_round_trip(tiny_model, h, tmp_path) -> None:
    model = tiny_model("mistral")
    config = KVCacheConfig(method="expected_attention", expected_attention_budget=10)
    caches = KVCacheBuilder.for_model(model, config)
    tokens = h.random_tokens(30, seed=5)
    mx.eval(model(tokens[:, :20], cache=caches))
    for t in range(20, 25):
        mx.eval(model(tokens[:, t : t + 1], cache=caches))
    path = str(tmp_path / "ea.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        assert a.settings == b.settings and a.offset == b.offset
        sa, sb = a.policy_state, b.policy_state
        assert sa.steps == sb.steps and sa.compressed == sb.compressed
        for name in ("scores", "mean", "cov", "log_norm"):
            np.testing.assert_array_equal(np.array(getattr(sa, name)), np.array(getattr(sb, name)))
    for t in range(25, 30):  # and both go on alike
        want = model(tokens[:, t : t + 1], cache=caches)
        got = model(tokens[:, t : t + 1], cache=loaded)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


class HandAttention(nn.Module):
    """Attention by hand: the cache sees keys and values, never the queries."""

    def __init__(self, dim: int = 32, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.rope = nn.RoPE(head_dim)

    def __call__(self, x: mx.array, cache) -> mx.array:
        B, L, _ = x.shape
        q, k, v = (
            y.reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
            for y in mx.split(self.qkv(x), 3, axis=-1)
        )
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, mask="causal" if L > 1 else None
        )
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


class HandBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = HandAttention()


class HandModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [HandBlock()]


def test_a_model_the_hook_cannot_reach_is_refused() -> None:
    config = KVCacheConfig(method="expected_attention")
    with pytest.raises(ValueError, match=r"computes attention by hand.*'expected_attention'"):
        KVCacheBuilder.for_model(HandModel(), config)


def test_a_cache_used_without_the_hook_refuses(tiny_model) -> None:
    """Made directly and driven by attention the hook never sees: the call that came without
    its queries is refused when the next one arrives."""
    config = KVCacheConfig(method="expected_attention", expected_attention_rope_base=1e4)
    cache = KVCacheFactory.create(config)
    attn = HandAttention()
    x = mx.random.normal((1, 5, 32))
    mx.eval(attn(x, cache))
    with pytest.raises(ValueError, match=r"needs the true queries.*attention hook"):
        attn(x[:, :1], cache)
