"""The sibling caches (H2O, StreamingLLM, SnapKV, MorphKV) on tiny random mlx-lm models.

Exact below budget, bounded and position-true under eviction, lossless through prompt-cache
files; StreamingLLM matches mlx-lm's ``RotatingKVCache``, MorphKV with ``window=1`` is TOVA, and
SnapKV cuts the prompt where mlx-lm's ``generate_step`` ends it.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, save_prompt_cache
from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache

import velox_cache_core.without_queries as vcache  # the warn-once sets
import velox_mlx_lm
from velox_mlx_lm import (
    H2OKVCache,
    KVCacheBuilder,
    KVCacheConfig,
    MorphKVCache,
    SnapKVCache,
    StreamingLLMKVCache,
)

METHODS = ("h2o", "streaming_llm", "snapkv", "morphkv")
CLASSES = {
    "h2o": H2OKVCache,
    "streaming_llm": StreamingLLMKVCache,
    "snapkv": SnapKVCache,
    "morphkv": MorphKVCache,
}
ARCHS = ("llama", "mistral")  # multi-head, and grouped-query (4 query heads per KV head)


def config(method: str, budget: int, **extra: object) -> KVCacheConfig:
    """A small-budget config; windows shrunk so they fit the budget."""
    fields: dict[str, object] = {f"{method}_budget": budget}
    if method in ("h2o", "streaming_llm", "morphkv"):
        fields[f"{method}_n_sink"] = 2
    if method == "snapkv":
        fields["snapkv_window"] = 4
    if method == "morphkv":
        fields["morphkv_window"] = 3
    fields.update({f"{method}_{k}": v for k, v in extra.items()})
    return KVCacheConfig(method=method, **fields)  # type: ignore[arg-type]


def _np(x: mx.array) -> np.ndarray:
    return np.array(x)


# -- exact below budget ------------------------------------------------------------------------

N = 24
CHUNKINGS = {"whole": None, "7": 7, "mixed": [10, 1, 1, 5, 1, 6]}


@pytest.fixture(scope="module")
def reference(tiny_model, h):
    tokens = h.random_tokens(N, seed=3)
    memo: dict[tuple[str, str], np.ndarray] = {}

    def get(arch: str, chunking: str) -> np.ndarray:
        if (arch, chunking) not in memo:
            model = tiny_model(arch)
            chunks = h.split(N, CHUNKINGS[chunking])
            memo[arch, chunking] = _np(
                h.forward_chunks(model, h.plain_cache(model), tokens, chunks)
            )
        return memo[arch, chunking]

    return tokens, get


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_within_budget_equals_kvcache(tiny_model, h, reference, method, arch, chunking):
    tokens, want = reference
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, config(method, N))
    assert all(type(c) is CLASSES[method] for c in cache)
    got = h.forward_chunks(model, cache, tokens, h.split(N, CHUNKINGS[chunking]))
    np.testing.assert_allclose(_np(got), want(arch, chunking), rtol=1e-5, atol=1e-5)
    for c in cache:
        assert c.offset == N and c.size() == N and c.compression_ratio == 1.0
        assert _np(c.positions).tolist() == [[list(range(N))] * c.positions.shape[1]]


# -- bounded, true offsets ---------------------------------------------------------------------

BUDGET = 10
SCHEDULE = [13, 1, 1, 1, 6, 1, 1, 9, *[1] * 12]  # prompt of 13, then mixed calls; 45 tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["h2o", "streaming_llm", "morphkv"])
def test_budget_and_offset_after_every_call(tiny_model, h, method, arch):
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, config(method, BUDGET))
    tokens = h.random_tokens(sum(SCHEDULE), seed=4)
    seen = 0
    for size in SCHEDULE:
        logits = h.forward_chunks(model, cache, tokens[:, seen : seen + size], [size])
        assert mx.all(mx.isfinite(logits)).item()
        seen += size
        for c in cache:
            assert c.offset == seen
            assert c.size() == min(seen, BUDGET)
            positions = _np(c.positions)
            assert positions.shape[-1] == min(seen, BUDGET)
            assert positions.max() == seen - 1  # the newest token is always kept
            assert (np.sort(positions, axis=-1)[..., :2] == [0, 1]).all()  # n_sink = 2
    assert cache[0].compression_ratio == pytest.approx(seen / BUDGET)


@pytest.mark.parametrize("arch", ARCHS)
def test_snapkv_bounded_after_the_prompt_then_grows_by_decode_tokens(tiny_model, h, arch):
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, config("snapkv", BUDGET))
    tokens = h.random_tokens(sum(SCHEDULE), seed=4)
    prompt = SCHEDULE[0]
    h.forward_chunks(model, cache, tokens[:, : prompt - 1], [5, 7])  # generate_step's prefill
    assert all(c.size() == c.offset == prompt - 1 for c in cache)  # nothing cut yet
    seen = prompt - 1
    for decoded in range(20):  # the prompt's last token alone ends the prompt, then decode
        h.forward_chunks(model, cache, tokens[:, seen : seen + 1], [1])
        seen += 1
        for c in cache:
            assert c.offset == seen
            assert c.size() == BUDGET + decoded
            assert _np(c.positions).max() == seen - 1


# -- prompt-cache files ------------------------------------------------------------------------


def _greedy(model, cache, steps: int) -> list[np.ndarray]:
    y, out = mx.array([[7]]), []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        mx.eval(logits)
        out.append(_np(logits))
        y = mx.argmax(logits, axis=-1)[:, None]
    return out


@pytest.mark.parametrize("method", METHODS)
def test_prompt_cache_round_trip_and_config_check(tmp_path, tiny_model, h, method):
    model = tiny_model("mistral")
    cfg = config(method, BUDGET)
    cache = KVCacheBuilder.for_model(model, cfg)
    h.forward_chunks(model, cache, h.random_tokens(25, seed=5), [20, 1, 1, 3])
    assert all(c.offset == 25 and c.size() < 25 for c in cache)  # evicted
    path = str(tmp_path / f"{method}.safetensors")
    save_prompt_cache(path, cache, metadata={"method": method})
    loaded, metadata = mlx_load_prompt_cache(path, return_metadata=True)
    assert metadata == {"method": method}
    for a, b in zip(cache, loaded, strict=True):
        assert type(b) is type(a)
        assert b.offset == a.offset == 25 and b.tokens_seen == a.tokens_seen
        assert b.settings == a.settings
        assert b.size() == a.size()
        assert np.array_equal(_np(b.positions), _np(a.positions))
        sa, sb = a.state, b.state
        assert sa.keys() == sb.keys() and sa["meta"] == sb["meta"]
        for k in sa:
            if isinstance(sa[k], mx.array):
                assert np.array_equal(_np(sa[k]), _np(sb[k])), k
    for x, y in zip(_greedy(model, cache, 4), _greedy(model, loaded, 4), strict=True):
        assert np.array_equal(x, y)

    # Loading against a config: the same settings pass, any other is refused by layer.
    ok = velox_mlx_lm.load_prompt_cache(path, cfg)
    assert [c.settings for c in ok] == [c.settings for c in loaded]
    budget_key = f"{method}_budget"
    other = config(method, BUDGET + 2)
    assert other.value(budget_key) != cfg.value(budget_key)
    with pytest.raises(ValueError, match="prompt cache layer 0 was saved as " + method):
        velox_mlx_lm.load_prompt_cache(path, other)
    with pytest.raises(ValueError, match="layer 0"):
        velox_mlx_lm.load_prompt_cache(path, KVCacheConfig(method="tova", tova_budget=BUDGET))
    with pytest.raises(ValueError, match="layer 0"):
        velox_mlx_lm.load_prompt_cache(path, KVCacheConfig(method="full"))


# -- StreamingLLM is mlx-lm's RotatingKVCache at decode ----------------------------------------


def _rows(keys: np.ndarray) -> np.ndarray:
    """``[H, n, D]`` rows in a canonical order (the ring buffer's order differs)."""
    return np.stack([k[np.lexsort(k.T[::-1])] for k in keys])


@pytest.mark.parametrize("arch", ARCHS)
def test_streaming_llm_decode_matches_rotating_kv_cache(tiny_model, h, arch):
    budget, n_sink, prompt, steps = 12, 3, 8, 45
    model = tiny_model(arch)
    ours = KVCacheBuilder.for_model(model, config("streaming_llm", budget, n_sink=n_sink))
    theirs = [RotatingKVCache(max_size=budget, keep=n_sink) for _ in model.layers]
    tokens = h.random_tokens(prompt, seed=6)
    a = h.forward_chunks(model, ours, tokens, [prompt])
    b = h.forward_chunks(model, theirs, tokens, [prompt])
    np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-5)
    y = mx.argmax(a[-1:], axis=-1)[None]
    for step in range(steps):
        la, lb = model(y, cache=ours), model(y, cache=theirs)
        mx.eval(la, lb, [c.state for c in ours], [c.state for c in theirs])
        np.testing.assert_allclose(_np(la), _np(lb), rtol=1e-5, atol=1e-5)
        seen = prompt + step + 1
        for c, r in zip(ours, theirs, strict=True):
            assert c.offset == r.offset == seen
            kept = list(range(n_sink)) + list(range(max(n_sink, seen - budget + n_sink), seen))
            assert c.size() == len(kept) == min(seen, budget)
            assert np.sort(_np(c.positions)[0], axis=-1).tolist() == [kept] * c.positions.shape[1]
            ring = _np(r.keys)[0, :, : min(seen, budget)]  # [H, n, D], ring order
            mine = _np(c.policy_state.slots.compact().keys)[0]
            assert ring.shape == mine.shape
            # the same rows; on the CPU a Velox decode step attends with its own softmax
            # (velox_cache_core.attention.attend_row), so later layers' keys may differ from
            # mlx-lm's in the last bits
            np.testing.assert_allclose(_rows(mine), _rows(ring), rtol=1e-5, atol=1e-6)
        y = mx.argmax(la[:, -1], axis=-1)[:, None]
    assert prompt + steps >= budget + 40


# -- MorphKV with window 1 is TOVA -------------------------------------------------------------


@pytest.mark.parametrize(
    ("signal", "scope", "prefill"),
    [("query", "layer", "sequential"), ("query", "head", "oneshot"), ("key", "head", "sequential")],
)
def test_morphkv_window_1_is_tova_bit_for_bit(tiny_model, h, signal, scope, prefill):
    model = tiny_model("mistral")
    common = {"budget": 9, "n_sink": 2, "signal": signal, "scope": scope, "prefill": prefill}
    tova = KVCacheConfig(method="tova", **{f"tova_{k}": v for k, v in common.items()})
    morph = KVCacheConfig(
        method="morphkv", morphkv_window=1, **{f"morphkv_{k}": v for k, v in common.items()}
    )
    tokens = h.random_tokens(40, seed=7)
    chunks = [14, 1, 1, 6, *[1] * 18]
    a = h.forward_chunks(model, KVCacheBuilder.for_model(model, tova), tokens, chunks)
    cache = KVCacheBuilder.for_model(model, morph)
    b = h.forward_chunks(model, cache, tokens, chunks)
    assert cache[0].size() == 9 and cache[0].offset == 40
    assert np.array_equal(_np(a), _np(b))


# -- SnapKV's prompt end -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_snapkv_prompt_end_under_generate_step(tiny_model, h, arch):
    model = tiny_model(arch)
    cache = KVCacheBuilder.for_model(model, config("snapkv", 16))
    prompt = h.random_tokens(40, seed=8)[0]
    sizes, offsets = [], []
    for _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=12, prefill_step_size=8):
        sizes.append({c.size() for c in cache})
        offsets.append({c.offset for c in cache})
    assert all(len(s) == 1 for s in sizes + offsets)
    sizes_, offsets_ = [s.pop() for s in sizes], [o.pop() for o in offsets]
    # generate_step computes one token ahead: at the n-th yield the model has seen n + 1 of
    # the generated tokens (or n, depending on the mlx-lm release).
    ahead = offsets_[0] - 40
    assert ahead in (0, 1)
    assert offsets_ == [40 + ahead + n for n in range(12)]
    assert sizes_ == [16 + ahead + n for n in range(12)]  # cut to 16, then + 1 per token
    assert all(c.policy_state.compressed for c in cache)


def test_snapkv_finish_prefill_compresses_explicitly(tiny_model, h):
    model = tiny_model("mistral")
    cache = KVCacheBuilder.for_model(model, config("snapkv", 16))
    tokens = h.random_tokens(35, seed=9)
    h.forward_chunks(model, cache, tokens[:, :30], [12, 12, 6])  # never a 1-token call
    assert all(c.size() == 30 and not c.policy_state.compressed for c in cache)
    for c in cache:
        c.finish_prefill()
    assert all(c.size() == 16 and c.offset == 30 and c.policy_state.compressed for c in cache)
    window = list(range(26, 30))  # the last snapkv_window=4 prompt tokens are always kept
    assert all((_np(c.positions)[..., -4:] == window).all() for c in cache)
    for c in cache:  # a second call is a no-op
        c.finish_prefill()
    assert all(c.size() == 16 for c in cache)
    h.forward_chunks(model, cache, tokens[:, 30:], [2, 1, 1, 1])  # then it grows
    assert all(c.size() == 21 and c.offset == 35 for c in cache)


# -- what siblings refuse ----------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_trim_is_exact_after_eviction(tiny_model, h, method):
    model = tiny_model("llama")
    cache = KVCacheBuilder.for_model(model, config(method, BUDGET))
    tokens = h.random_tokens(20, seed=10)
    h.forward_chunks(model, cache, tokens, [6])
    assert cache[0].is_trimmable()
    assert cache[0].trim(2) == 2 and cache[0].offset == 4
    h.forward_chunks(model, cache, tokens[:, 4:], [12, 1, 1, 2])
    assert cache[0].size() < cache[0].offset == 20  # evicted (SnapKV: cut at the 1-token call)
    assert cache[0].trim(3) == 3  # the 2-token chunk and one decode token
    prefix = KVCacheBuilder.for_model(model, config(method, BUDGET))
    h.forward_chunks(model, prefix, tokens, [4, 12, 1])
    assert cache[0].offset == prefix[0].offset == 17
    assert np.array_equal(np.sort(_np(cache[0].positions)), np.sort(_np(prefix[0].positions)))
    with pytest.raises(ValueError, match="cannot trim"):
        cache[0].trim(cache[0].offset + 1)


@pytest.mark.parametrize("cls", [H2OKVCache, MorphKVCache])
def test_query_signal_without_the_hook_settles_with_key_and_warns(monkeypatch, cls):
    monkeypatch.setattr(vcache, "_warned_no_hook", set())
    settings = {"budget": 6, "n_sink": 1, "signal": "query", "scope": "head"}
    if cls is MorphKVCache:
        settings["window"] = 3
    no_hook = cls(**settings)
    by_key = cls(**{**settings, "signal": "key"})
    rng = np.random.default_rng(11)
    chunks = [mx.array(rng.standard_normal((1, 2, n, 8)), dtype=mx.float32) for n in (5, 4, 1)]
    with pytest.warns(RuntimeWarning, match="without the attention hook"):
        for x in chunks:
            k, _ = no_hook.update_and_fetch(x, x * 0.5)
            assert k.shape[2] == min(no_hook.offset - x.shape[2], 6) + x.shape[2]
            by_key.update_and_fetch(x, x * 0.5)
        assert no_hook.size() == 6 and no_hook.offset == 10
    assert no_hook.settings["signal"] == "query"  # the fallback is per call, not a new setting
    assert np.array_equal(_np(no_hook.positions), _np(by_key.positions))
    with warnings.catch_warnings():  # warned once per policy
        warnings.simplefilter("error")
        no_hook.update_and_fetch(chunks[2], chunks[2])
        assert no_hook.size() == 6
