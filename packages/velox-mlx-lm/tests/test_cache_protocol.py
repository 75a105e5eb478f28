"""The mlx-lm cache protocol around TOVAKVCache: use without the hook, prompt-cache files, trim
and speculative decoding, batching, bad input, the hook itself and gemma3's mixed caches."""

from __future__ import annotations

import dataclasses
import json
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import (
    generate_step,
    speculative_generate_step,
    stream_generate,
)
from mlx_lm.models import base, gemma3_text, llama
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

import velox_cache_core.without_queries as vcache  # the warn-once sets
from velox_mlx_lm import (
    KVCacheBuilder,
    KVCacheConfig,
    KVCacheFactory,
    TOVAKVCache,
    install_attention_hook,
)
from velox_mlx_lm.hook import velox_scaled_dot_product_attention


def _kv(L, seed, H=2, D=8):
    k = mx.random.normal((1, H, L, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, L, D), key=mx.random.key(seed + 1000))
    return k, v


def _snapshot(cache):
    return {k: (np.array(v) if isinstance(v, mx.array) else v) for k, v in cache.state.items()}


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], np.ndarray):
            assert np.array_equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name


# -- without the hook ---------------------------------------------------------------------------

NO_HOOK_CHUNKS = [5, 1, 1, 9, 1, 3, 1, 1, 1, 12, 1]


@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("signal", ["query", "key"])
def test_without_hook_returns_retained_then_new_and_stays_in_budget(monkeypatch, signal, scope):
    budget = 8
    monkeypatch.setattr(vcache, "_warned_no_hook", set())
    cache = TOVAKVCache(budget=budget, n_sink=2, signal=signal, scope=scope)
    seen = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, L in enumerate(NO_HOOK_CHUNKS):
            retained = cache.tova_state  # settles the previous chunk, as the next call would
            slots = cache.policy_state.slots
            freed = slots is not None and slots.free is not None
            keys, values = _kv(L, seed=i)
            k, v = cache.update_and_fetch(keys, values)
            n = retained.n_kept
            assert k.shape[2] == v.shape[2] == n + L
            if L > 1 or (signal == "query" and not freed):
                assert mx.array_equal(k[:, :, n:], keys) and mx.array_equal(v[:, :, n:], values)
                if n:
                    assert mx.array_equal(k[:, :, :n], retained.keys)
                    assert mx.array_equal(v[:, :, :n], retained.values)
            else:  # decode writes the new row into the freed slot (no mask at L=1)
                _assert_retained_plus_one(k, retained.keys, keys)
                _assert_retained_plus_one(v, retained.values, values)
            # A hand-written attention that ignores the cache's policy: plain causal mask.
            q = mx.random.normal((1, 4, L, 8), key=mx.random.key(i + 2000))
            out = mx.fast.scaled_dot_product_attention(
                q, k, v, scale=8**-0.5, mask="causal" if L > 1 else None
            )
            assert out.shape == (1, 4, L, 8) and mx.all(mx.isfinite(out)).item()
            seen += L
            assert cache.offset == seen
            assert cache.size() == min(seen, budget)
            assert cache.tova_state.n_kept <= budget
    no_hook = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(no_hook) == (1 if signal == "query" else 0)
    if no_hook:
        assert "attention hook" in str(no_hook[0].message)


def _assert_retained_plus_one(got, retained, new):
    """Per head, ``got`` is ``retained`` with ``new`` written at one row (the freed slot)."""
    got, retained, new = np.array(got[0]), np.array(retained[0]), np.array(new[0])
    for head in range(got.shape[0]):
        hits = np.nonzero(np.all(got[head] == new[head], axis=-1))[0]
        assert len(hits) == 1
        assert np.array_equal(np.delete(got[head], hits[0], axis=0), retained[head])


def test_without_hook_query_signal_settles_like_key_signal(monkeypatch):
    monkeypatch.setattr(vcache, "_warned_no_hook", {"tova"})
    by_query = TOVAKVCache(budget=8, n_sink=2, signal="query")
    by_key = TOVAKVCache(budget=8, n_sink=2, signal="key")
    for i, L in enumerate(NO_HOOK_CHUNKS):
        keys, values = _kv(L, seed=i)
        by_query.update_and_fetch(keys, values)
        by_key.update_and_fetch(keys, values)
        a, b = by_query.tova_state, by_key.tova_state
        assert mx.array_equal(a.positions, b.positions)
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    assert by_query.settings["signal"] == "query"  # the fallback is per call, not a new setting


class HandAttention(nn.Module):
    """Attention written by hand: calls the cache, then mx.fast directly (no hook reaches it)."""

    def __init__(self, dim=32, n_heads=4, n_kv_heads=2, head_dim=8):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rope = nn.RoPE(head_dim)

    def __call__(self, x, cache):
        B, L, _ = x.shape

        def heads(y, n):
            return y.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

        q = self.rope(heads(self.q_proj(x), self.n_heads), offset=cache.offset)
        k = self.rope(heads(self.k_proj(x), self.n_kv_heads), offset=cache.offset)
        k, v = cache.update_and_fetch(k, heads(self.v_proj(x), self.n_kv_heads))
        out = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.head_dim**-0.5, mask="causal" if L > 1 else None
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class HandBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = HandAttention()

    def __call__(self, x, cache):
        return x + self.self_attn(x, cache)


class HandModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.layers = [HandBlock(), HandBlock()]

    def __call__(self, tokens, cache):
        x = self.embed(tokens)
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, c)
        return self.embed.as_linear(x)


@pytest.fixture(scope="module")
def hand_model():
    mx.random.seed(7)
    model = HandModel()
    mx.eval(model.parameters())
    return model


def test_hand_written_attention_model(monkeypatch, hand_model, h):
    monkeypatch.setattr(vcache, "_warned_no_hook", {"tova"})
    assert install_attention_hook(hand_model) == 0
    with pytest.warns(RuntimeWarning, match="tova_signal='key'"):
        cache = KVCacheBuilder.for_model(hand_model, KVCacheConfig(tova_budget=40))
    assert all(c.settings["signal"] == "key" for c in cache)
    # Within budget it is exactly mlx-lm's KVCache, with the cache's bottom-right causal mask.
    tokens = h.random_tokens(40, seed=8)
    chunks = [7, 1, 1, 20, 11]
    want = h.forward_chunks(hand_model, [KVCache(), KVCache()], tokens, chunks)
    got = h.forward_chunks(hand_model, cache, tokens, chunks)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # With eviction it runs and stays within budget after every call.
    with pytest.warns(RuntimeWarning, match="computes attention by hand"):
        config = KVCacheConfig(tova_budget=6, tova_n_sink=1)
        cache = KVCacheBuilder.for_model(hand_model, config)
    tokens = h.random_tokens(60, seed=9)
    seen = 0
    for L in [9, 1, 1, 1, 17, 1, 30]:
        logits = hand_model(tokens[:, seen : seen + L], cache)
        mx.eval(logits)
        seen += L
        assert mx.all(mx.isfinite(logits)).item()
        assert all(c.offset == seen and c.size() == 6 for c in cache)


# -- prompt caches ------------------------------------------------------------------------------


def _greedy_logits(model, cache, first, steps):
    y, out = first, []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        mx.eval(logits)
        out.append(np.array(logits))
        y = mx.argmax(logits, axis=-1)[:, None]
    return out


@pytest.mark.parametrize("decode_steps", [0, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prompt_cache_round_trip(tmp_path, tiny_model, h, arch, decode_steps):
    model = tiny_model(arch)
    config = KVCacheConfig(tova_budget=9, tova_n_sink=2, tova_scope="head")
    cache = KVCacheBuilder.for_model(model, config)
    tokens = h.random_tokens(25 + decode_steps, seed=10)
    h.forward_chunks(model, cache, tokens, [25] + [1] * decode_steps)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, cache, metadata={"note": "velox"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"note": "velox"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for a, b in zip(cache, loaded, strict=True):
        if isinstance(a, TOVAKVCache):
            _assert_same_state(_snapshot(a), _snapshot(b))
            assert b.offset == a.offset == 25 + decode_steps
            assert b.settings == a.settings == config.tova_settings()
            assert mx.array_equal(b.positions, a.positions)
            assert b.tokens_seen == a.tokens_seen
    # Greedy generation continues identically from both.
    first = mx.array([[5]])
    for x, y in zip(
        _greedy_logits(model, cache, first, 6), _greedy_logits(model, loaded, first, 6), strict=True
    ):
        assert np.array_equal(x, y)


def test_prompt_cache_round_trip_of_an_unused_cache(tmp_path):
    path = str(tmp_path / "empty.safetensors")
    save_prompt_cache(path, [TOVAKVCache(budget=5, n_sink=1, preset="tova_adapted")])
    (loaded,) = load_prompt_cache(path)
    assert loaded.empty() and loaded.offset == 0 and loaded.positions is None
    assert loaded.settings == TOVAKVCache(budget=5, n_sink=1, preset="tova_adapted").settings


# -- trim and speculative decoding --------------------------------------------------------------


def test_trim_is_exact_within_the_undo_log(tiny_model, h):
    model = tiny_model("llama")
    config = KVCacheConfig(tova_budget=16, tova_n_sink=2, trim_window=12)
    tokens = h.random_tokens(34, seed=11)
    cache = KVCacheBuilder.for_model(model, config)
    assert all(c.is_trimmable() and c.trim_window == 12 for c in cache)
    h.forward_chunks(model, cache, tokens, [10])
    assert all(c.trimmable_tokens == 10 for c in cache)
    assert all(c.trim(0) == 0 for c in cache)
    assert all(c.trim(3) == 3 for c in cache)
    assert all(c.trimmable_tokens == 7 for c in cache)
    assert all(c.offset == 7 and c.size() == 7 for c in cache)
    assert np.array(cache[0].positions).tolist() == [[list(range(7))] * 4]
    # Re-feeding the trimmed tokens gives what an untrimmed cache gives.
    got = h.forward_chunks(model, cache, tokens[:, 7:], [3, 1, 1, 13])
    fresh = KVCacheBuilder.for_model(model, config)
    want = h.forward_chunks(model, fresh, tokens, [7, 3, 1, 1, 13])[7:]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # After eviction too: trimming a chunk that evicted equals never feeding its tail.
    assert cache[0].size() == 16 and cache[0].offset == 25
    h.forward_chunks(model, cache, tokens[:, 25:], [1, 4, 1])
    assert all(c.trim(4) == 4 for c in cache)  # the last token and 3 of the 4-token chunk
    prefix = KVCacheBuilder.for_model(model, config)
    h.forward_chunks(model, prefix, tokens[:, :27], [7, 3, 1, 1, 13, 1, 1])
    for a, b in zip(cache, prefix, strict=True):
        assert a.offset == b.offset == 27
        assert np.array_equal(np.sort(np.array(a.positions)), np.sort(np.array(b.positions)))
    # Beyond the log: a clear error and an untouched cache.
    # The 13-token call was longer than the window and cleared the log: only the 6 tokens fed
    # after it, less the 4 trimmed, can be taken back.
    assert cache[0].trimmable_tokens == 2
    before = _snapshot(cache[0])
    with pytest.raises(ValueError, match="cannot trim 13 tokens"):
        cache[0].trim(13)
    _assert_same_state(before, _snapshot(cache[0]))
    off = TOVAKVCache(budget=4, n_sink=0, trim_window=0)
    assert not off.is_trimmable() and off.trimmable_tokens == 0
    with pytest.raises(ValueError, match="trim_window=0"):
        off.trim(1)


def test_speculative_decoding_matches_plain_decoding(tiny_model, h):
    model, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    config = KVCacheConfig(tova_budget=8)
    prompt = h.random_tokens(12, seed=12)[0]
    caches = KVCacheBuilder.for_model(model, config) + KVCacheBuilder.for_model(draft, config)
    spec = [
        int(t)
        for t, _, _ in speculative_generate_step(
            prompt, model, draft, prompt_cache=caches, max_tokens=24, num_draft_tokens=3
        )
    ]
    plain_caches = KVCacheBuilder.for_model(model, config)
    plain = [
        int(t) for t, _ in generate_step(prompt, model, prompt_cache=plain_caches, max_tokens=24)
    ]
    assert spec == plain
    main = caches[: len(model.layers)]
    for a, b in zip(main, plain_caches, strict=True):
        assert a.size() <= 8 and b.size() <= 8
    # A cache without an undo log is refused, through a model's make_cache too.
    off = KVCacheConfig(tova_budget=8, trim_window=0)
    fresh = tiny_model("llama", fresh=True)
    fresh.make_cache = lambda: KVCacheBuilder.for_model(fresh, off)
    with pytest.raises(ValueError, match="TOVAKVCache"):
        next(speculative_generate_step(prompt, fresh, draft, max_tokens=4))


def test_stream_generate_with_draft_model_without_undo_log_is_refused(
    tiny_model, tiny_tokenizer, h
):
    model, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    off = KVCacheConfig(tova_budget=8, trim_window=0)
    caches = KVCacheBuilder.for_model(model, off) + KVCacheBuilder.for_model(draft, off)
    prompt = h.random_tokens(12, seed=12)[0].tolist()
    with pytest.raises(ValueError, match="trimmable"):
        next(
            stream_generate(
                model, tiny_tokenizer, prompt, draft_model=draft, prompt_cache=caches, max_tokens=3
            )
        )


# -- bad input ----------------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"method": 3}, TypeError, "method"),
    ({"method": "quest"}, ValueError, "method"),
    ({"tova_budget": 0}, ValueError, "tova_budget"),
    ({"tova_budget": "512"}, TypeError, "tova_budget"),
    ({"tova_budget": True}, TypeError, "tova_budget"),
    ({"tova_budget": 8.0}, TypeError, "tova_budget"),
    ({"tova_n_sink": -1}, ValueError, "tova_n_sink"),
    ({"tova_n_sink": None}, TypeError, "tova_n_sink"),
    ({"tova_budget": 4, "tova_n_sink": 4}, ValueError, "tova_n_sink"),
    ({"tova_signal": "keys"}, ValueError, "tova_signal"),
    ({"tova_scope": "model"}, ValueError, "tova_scope"),
    ({"tova_prefill": "chunked"}, ValueError, "tova_prefill"),
    ({"head_dim": 0}, ValueError, "head_dim"),
    ({"head_dim": 64.0}, TypeError, "head_dim"),
]


@pytest.mark.parametrize(("kwargs", "error", "field"), BAD_CONFIGS, ids=lambda x: str(x))
def test_bad_config_names_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        KVCacheConfig(**kwargs)


def test_config_is_frozen_and_fills_preset_defaults():
    config = KVCacheConfig(method="tova_adapted", tova_budget=64, tova_scope="layer")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tova_budget = 8  # type: ignore[misc]
    assert config.tova_settings() == {
        "budget": 64,
        "n_sink": 4,
        "signal": "key",
        "scope": "layer",
        "prefill": "sequential",
        "allocation": "uniform",
        "allocation_floor": 0.2,
    }
    cache = KVCacheFactory.create(config)
    assert isinstance(cache, TOVAKVCache) and cache.settings == config.tova_settings()
    assert type(KVCacheFactory.create(KVCacheConfig(method="full"))) is KVCache


def test_builder_rejects_wrong_arguments(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheFactory.create({"method": "tova"})
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheBuilder.for_model(model, {"method": "tova"})
    with pytest.raises(TypeError, match="layers"):
        KVCacheBuilder.for_model(nn.Linear(2, 2), KVCacheConfig())


@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 8), ("mistral", 8), ("gemma3", 16)])
def test_head_dim_is_checked_against_the_model(tiny_model, arch, head_dim):
    model = tiny_model(arch)
    assert len(KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=head_dim))) == len(
        model.layers
    )
    with pytest.raises(ValueError, match=rf"head_dim=32 does not match .*\[{head_dim}\]"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=32))
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheBuilder.for_model(model, KVCacheConfig(method="full", head_dim=32))


@pytest.mark.parametrize("signal", ["query", "key"])
def test_cache_reused_for_another_model_is_refused_unchanged(tiny_model, h, signal):
    model, other = tiny_model("llama"), tiny_model("mistral")  # 4 vs 2 KV heads
    config = KVCacheConfig(tova_budget=8, tova_signal=signal)
    cache = KVCacheBuilder.for_model(model, config)
    tokens = h.random_tokens(13, seed=13)
    h.forward_chunks(model, cache, tokens[:, :12], [12])
    before = [_snapshot(c) for c in cache]
    with pytest.raises(ValueError, match=r"H_kv \(2\) differs from the state's H_kv \(4\)"):
        other(tokens[:, :3], cache=cache)
    for c, snap in zip(cache, before, strict=True):
        _assert_same_state(snap, _snapshot(c))
        assert c.offset == 12
    # Still serves its own model exactly as an untouched copy does.
    twin = KVCacheBuilder.for_model(model, config)
    h.forward_chunks(model, twin, tokens[:, :12], [12])
    got = h.forward_chunks(model, cache, tokens[:, 12:], [1])
    assert np.array_equal(
        np.array(got), np.array(h.forward_chunks(model, twin, tokens[:, 12:], [1]))
    )


@pytest.mark.parametrize("signal", ["query", "key"])
def test_cache_rejects_other_head_dim_or_dtype_unchanged(monkeypatch, signal):
    monkeypatch.setattr(vcache, "_warned_no_hook", {"tova"})
    cache = TOVAKVCache(budget=4, n_sink=1, signal=signal)
    cache.update_and_fetch(*_kv(6, seed=1))
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"D \(16\) differs from the state's D \(8\)"):
        cache.update_and_fetch(*_kv(1, seed=2, D=16))
    k, v = _kv(1, seed=2)
    with pytest.raises(TypeError, match="dtype"):
        cache.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    with pytest.raises(ValueError, match=r"values must be \[B, H_kv, L, D_v\]"):
        cache.update_and_fetch(k, v[:, :1])
    with pytest.raises(ValueError, match=r"values D_v \(4\) differs from the state's D_v \(8\)"):
        cache.update_and_fetch(k, v[..., :4])
    _assert_same_state(before, _snapshot(cache))
    assert cache.offset == 6


def test_loaded_prompt_cache_keeps_its_own_settings(tmp_path, tiny_model, h):
    """Loaded without a config, the caches carry the settings they were saved with (never the
    caller's), and a saved state whose rows exceed its budget, or whose settings are invalid, is
    refused. Checking a file against the caller's settings is
    ``velox_mlx_lm.load_prompt_cache(path, config=...)`` (tested in test_siblings_mlx.py)."""
    model = tiny_model("llama")
    saved = KVCacheConfig(tova_budget=8, tova_n_sink=2)
    cache = KVCacheBuilder.for_model(model, saved)
    h.forward_chunks(model, cache, h.random_tokens(20, seed=14), [20])
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, cache)
    expected = KVCacheConfig(tova_budget=16, tova_n_sink=2)
    loaded = load_prompt_cache(path)
    assert all(c.settings == saved.tova_settings() != expected.tova_settings() for c in loaded)
    state = dict(cache[0].state)
    state["meta"] = json.dumps({**json.loads(state["meta"]), "budget": 4})
    with pytest.raises(ValueError, match=r"more rows \(8\) than budget 4"):
        TOVAKVCache.from_state(state)
    state["meta"] = json.dumps({**json.loads(state["meta"]), "budget": 8, "scope": "x"})
    with pytest.raises(ValueError, match="scope"):
        TOVAKVCache.from_state(state)


# -- the hook -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_hook_is_idempotent_and_harmless_to_other_caches(monkeypatch, tiny_model, h, arch):
    model = tiny_model(arch)
    module = type(model.layers[0].self_attn).__call__.__globals__
    tokens = h.random_tokens(30, seed=15)
    chunks = [17, 1, 1, 11]
    with monkeypatch.context() as m:
        m.setitem(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
        before = np.array(h.forward_chunks(model, h.plain_cache(model), tokens, chunks))
        first = install_attention_hook(model)
        assert module["scaled_dot_product_attention"] is velox_scaled_dot_product_attention
        assert install_attention_hook(model) == first >= 1
        assert module["scaled_dot_product_attention"] is velox_scaled_dot_product_attention
        after = np.array(h.forward_chunks(model, h.plain_cache(model), tokens, chunks))
    assert np.array_equal(before, after)


def test_hook_passes_other_caches_through_unchanged():
    q = mx.random.normal((1, 4, 3, 8), key=mx.random.key(1))
    k, v = _kv(5, seed=3)
    for cache in (None, KVCache(), RotatingKVCache(max_size=8)):
        got = velox_scaled_dot_product_attention(q, k, v, cache=cache, scale=0.3, mask=None)
        want = base.scaled_dot_product_attention(q, k, v, cache=cache, scale=0.3, mask=None)
        assert mx.array_equal(got, want)


def test_hook_honours_the_models_own_keys_and_scores():
    # Absorbed latent attention attends over keys derived from the cached rows and adds RoPE
    # scores through the mask: served exactly, the call scored with signal key and a warning.
    cache = TOVAKVCache(budget=64, n_sink=1, signal="query", trim_window=0)
    cache.layer.serves = "toy_mla (layer 0)"
    k, v = cache.update_and_fetch(*_kv(5, seed=3))
    q = mx.random.normal((1, 4, 5, 8), key=mx.random.key(1))
    own_keys, own_values = k * 2.0, v[..., :6] + 1.0
    scores = mx.random.normal((1, 4, 5, 5), key=mx.random.key(2))
    causal = mx.arange(5)[None, :] <= mx.arange(5)[:, None]
    want = mx.fast.scaled_dot_product_attention(
        q, own_keys, own_values, scale=0.3, mask=mx.where(causal, scores, -1e30)
    )
    with pytest.warns(RuntimeWarning, match=r"toy_mla.*signal 'key'"):
        got = velox_scaled_dot_product_attention(
            q, own_keys, own_values, cache=cache, scale=0.3, mask=scores
        )
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    with pytest.raises(ValueError, match=r"toy_mla.*attends over 4 rows"):
        k, v = cache.update_and_fetch(*_kv(1, seed=4))
        velox_scaled_dot_product_attention(
            q[:, :, :1], k[:, :, :4], v[:, :, :4], cache=cache, scale=0.3, mask=None
        )


def test_shared_kv_layers_attend_over_the_owners_last_call():
    # gemma3n's KV-shared layers read keys_and_values() and attend with the owner's cache.
    cache = TOVAKVCache(budget=4, n_sink=1)
    k, v = cache.update_and_fetch(*_kv(6, seed=5))
    q = mx.random.normal((1, 4, 6, 8), key=mx.random.key(6))
    first = velox_scaled_dot_product_attention(q, k, v, cache=cache, scale=0.3, mask="causal")
    shared_k, shared_v = cache.keys_and_values()
    assert shared_k is k and shared_v is v
    again = velox_scaled_dot_product_attention(
        q, shared_k, shared_v, cache=cache, scale=0.3, mask="causal"
    )
    assert mx.array_equal(first, again)
    assert cache.size() == 4


# -- gemma3: sliding layers keep mlx-lm's RotatingKVCache ---------------------------------------


def test_gemma3_keeps_rotating_caches_for_sliding_layers(tiny_model, h):
    model = tiny_model("gemma3")
    cache = KVCacheBuilder.for_model(model, KVCacheConfig(tova_budget=8, tova_n_sink=2))
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, TOVAKVCache]
    assert [type(c) for c in KVCacheBuilder.for_model(model, KVCacheConfig(method="full"))] == [
        RotatingKVCache,
        RotatingKVCache,
        KVCache,
    ]
    assert all(
        a.is_sliding != isinstance(c, TOVAKVCache)
        for a, c in zip((layer.self_attn for layer in model.layers), cache, strict=True)
    )
    logits = h.forward_chunks(model, cache, h.random_tokens(40, seed=16), [23, 1, 1, 15])
    assert mx.all(mx.isfinite(logits)).item()
    assert cache[2].offset == 40 and cache[2].size() == 8
    assert all(c.offset == 40 for c in cache)
    assert isinstance(gemma3_text.Model.make_cache(model)[0], RotatingKVCache)


def test_make_mask_refuses_a_window():
    cache = TOVAKVCache(budget=8, n_sink=1, signal="key")
    cache.update_and_fetch(*_kv(12, seed=4))
    with pytest.raises(ValueError, match=r"window_size=8.*RotatingKVCache"):
        cache.make_mask(3, window_size=8)
    assert cache.make_mask(1) is None
    assert cache.make_mask(3) == "causal"
    mask = cache.make_mask(3, return_array=True)
    assert mask.shape == (3, 11)
    assert mx.array_equal(mask, mx.arange(11)[None] <= mx.arange(8, 11)[:, None])


def test_llama_module_is_hooked_by_the_builder(tiny_model):
    KVCacheBuilder.for_model(tiny_model("llama"), KVCacheConfig())
    assert llama.scaled_dot_product_attention is velox_scaled_dot_product_attention


def test_duck_typing_keeps_mlx_lm_on_the_plain_path():
    """No ``bits`` (would route to quantized attention); truthy even when empty (mlx-lm skips a
    falsy cache in ``if cache and hasattr(cache, "make_mask")``)."""
    cache = TOVAKVCache(budget=4, n_sink=1)
    assert not hasattr(cache, "bits")
    assert cache.empty() and bool(cache)
    assert base.create_attention_mask(mx.zeros((1, 3, 8)), cache) == "causal"
    assert cache.offset == 0 and isinstance(cache.offset, int)


@pytest.mark.parametrize("method", ["tova", "tova_adapted", "h2o", "morphkv", "streaming_llm"])
def test_trim_after_prompt_cache_round_trip(tiny_model, h, tmp_path, method):
    """The undo log is saved with the cache: a loaded cache trims exactly like the original."""
    model = tiny_model("llama")
    policy = "tova" if method.startswith("tova") else method
    extra = {"morphkv_window": 3} if method == "morphkv" else {}
    config = KVCacheConfig(method=method, **{f"{policy}_budget": 8}, **extra)
    cache = KVCacheBuilder.for_model(model, config)
    h.forward_chunks(model, cache, h.random_tokens(22, seed=4), [14, 1, 4, 1, 1, 1])
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for a, b in zip(cache, loaded, strict=True):
        assert b.trim_window == a.trim_window and b.undo_nbytes == a.undo_nbytes > 0
        assert a.trim(6) == b.trim(6) == 6
        assert a.offset == b.offset == 16
        _assert_same_state(_snapshot(a), _snapshot(b))
