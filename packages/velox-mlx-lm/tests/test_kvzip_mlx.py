"""KVzip on tiny mlx-lm models (velox_mlx_lm.kvzip): compress a prefilled context once, save it,
and ask it several questions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from velox_cache_core.policies.kvzip import PAD
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, cli
from velox_mlx_lm.cache import KVzipKVCache
from velox_mlx_lm.kvzip import compress, prefill, reconstruction_chunks, reply_prefix

N = 40


def context(seed: int = 0, n: int = N) -> list[int]:
    return np.random.default_rng(seed).integers(2, 128, size=n).tolist()


def zipped(model: Any, tokenizer: Any, tokens: list[int], **settings: Any) -> list[Any]:
    config = KVCacheConfig(method="kvzip", **{"kvzip_budget": 12, "kvzip_n_sink": 2, **settings})
    caches = KVCacheBuilder.for_model(model, config)
    prefill(model, caches, tokens, step=16)
    compress(model, tokenizer, caches, tokens, chunk_size=16)
    return caches


def answer(model: Any, caches: list[Any], question: list[int], n: int = 6) -> list[int]:
    steps = generate_step(mx.array(question), model, prompt_cache=caches, max_tokens=n)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize(
    ("arch", "allocation"),
    [("llama", "uniform"), ("mistral", "uniform"), ("llama", "global"), ("mistral", "head")],
)
def test_compress_leaves_the_context_alone(
    tiny_model: Any, tiny_tokenizer: Any, arch: str, allocation: str
) -> None:
    model = tiny_model(arch)
    tokens = context()
    caches = zipped(model, tiny_tokenizer, tokens, kvzip_allocation=allocation)
    full = [KVCache() for _ in model.layers]
    model(mx.array(tokens)[None], cache=full)
    real_rows = []
    for cache, plain in zip(caches, full, strict=True):
        state = cache.policy_state
        assert type(cache) is KVzipKVCache and state.compressed and not cache.scoring
        assert cache.offset == N  # no reconstruction token stays
        positions = np.array(cache.positions)
        real = positions != PAD
        assert (positions[..., :2] == [0, 1]).all() and (positions[real] < N).all()
        real_rows.append(real.sum(axis=-1))
        if allocation == "uniform":
            assert cache.size() == 12 and real.all()
        elif allocation == "head":  # 12 rows per head on average, in every layer
            assert real.sum() == 12 * positions.shape[1]
        if allocation != "uniform":  # held as lanes: the bytes of the rows kept, no pads
            row = 2 * np.array(state.keys).shape[-1] * 4  # a key and a value, float32
            assert cache.nbytes == int(real.sum()) * row
        # The kept rows are the context's own (rotated at their true positions).
        safe = np.where(real, positions, 0)
        want = np.take_along_axis(np.array(plain.keys[..., :N, :]), safe[..., None], axis=2)
        np.testing.assert_allclose(np.array(state.keys)[real], want[real], rtol=1e-5, atol=1e-6)
    # 12 rows per head on average over the whole model ("global": one threshold).
    rows = np.stack(real_rows)
    assert rows.sum() == 12 * rows.size
    if allocation != "uniform":  # heads keep different counts
        assert len(set(rows.ravel().tolist())) > 1
    # Different rows survive per KV head: a per-head budget, not one cut per layer.
    assert any(len({tuple(r) for r in np.array(c.positions)[0].tolist()}) > 1 for c in caches)


def test_scoring_chunks_are_bounded_and_cover_the_context(tiny_tokenizer: Any) -> None:
    tokens = context(n=37)
    chunks = reconstruction_chunks(tiny_tokenizer, tokens, chunk_size=16)
    assert [(s, e) for s, e, _ in chunks] == [(0, 16), (16, 32), (32, 37)]
    reply = reply_prefix(tiny_tokenizer)  # no chat template: a newline
    for start, end, ids in chunks:
        assert ids[-(end - start) :] == tokens[start:end]
        assert ids[-(end - start) - len(reply) : -(end - start)] == reply
    assert chunks[1][2][: -(16 + len(reply))][-8:] == tokens[8:16]  # quotes the previous chunk


def test_prompt_cache_round_trip_and_many_questions(
    tiny_model: Any, tiny_tokenizer: Any, tmp_path: Path
) -> None:
    model = tiny_model("llama")
    tokens = context(seed=1)
    caches = zipped(model, tiny_tokenizer, tokens)
    path = str(tmp_path / "doc.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        assert type(b) is KVzipKVCache and b.settings == a.settings
        assert b.offset == a.offset == N and b.policy_state.compressed
        assert mx.array_equal(b.positions, a.positions)
        assert mx.array_equal(b.policy_state.keys, a.policy_state.keys)
    questions = [[5, 9, 17, 3], [60, 61, 2, 100, 7]]
    answers = []
    for question in questions:
        reused = answer(model, load_prompt_cache(path), question)
        afresh = answer(model, zipped(model, tiny_tokenizer, tokens), question)
        assert reused == afresh
        answers.append(reused)
    assert answers[0] != answers[1]
    # The file is untouched by the questions: the first one again gives the same answer.
    assert answer(model, load_prompt_cache(path), questions[0]) == answers[0]


def test_budget_override_and_after_tova(tiny_model: Any, tiny_tokenizer: Any) -> None:
    model = tiny_model("mistral")
    tokens = context(seed=2)
    config = KVCacheConfig(method="kvzip", kvzip_budget=30, kvzip_n_sink=1, kvzip_after="tova")
    caches = KVCacheBuilder.for_model(model, config)
    prefill(model, caches, tokens)
    info = compress(model, tiny_tokenizer, caches, tokens, budget=10, chunk_size=64)
    assert info["chunks"] == 1 and info["scored_tokens"] > N
    assert all(c.size() == 10 and c.settings["budget"] == 10 for c in caches)
    answer(model, caches, [3, 4, 5, 6], n=5)
    assert all(c.size() <= 10 and c.offset >= N + 8 for c in caches)  # TOVA keeps the budget


def test_latest_probe_is_tovas_oneshot_cut(tiny_model: Any, tiny_tokenizer: Any) -> None:
    model = tiny_model("mistral")
    tokens = context(seed=3)
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(method="kvzip", kvzip_budget=12, kvzip_probe="latest")
    )
    prefill(model, caches, tokens, step=N)
    assert compress(model, tiny_tokenizer, caches, tokens)["scored_tokens"] == 0
    tova = KVCacheBuilder.for_model(
        model,
        KVCacheConfig(method="tova", tova_budget=12, tova_scope="head", tova_prefill="oneshot"),
    )
    prefill(model, tova, tokens, step=N)
    for a, b in zip(caches, tova, strict=True):
        assert mx.array_equal(a.positions, b.positions)
        assert mx.array_equal(a.policy_state.keys, b.policy_state.keys)


def test_compress_refuses_other_caches_and_token_mismatch(
    tiny_model: Any, tiny_tokenizer: Any
) -> None:
    model = tiny_model("llama")
    tova = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova"))
    with pytest.raises(ValueError, match="model-driven phase"):
        compress(model, tiny_tokenizer, tova, context())
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip"))
    prefill(model, caches, context())
    with pytest.raises(ValueError, match="tokens were given"):
        compress(model, tiny_tokenizer, caches, context()[:-1])


@pytest.mark.model
def test_velox_generate_kvzip(capsys: pytest.CaptureFixture[str], embedded_model_path: Any) -> None:
    document = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(30))
    code = cli.main(
        [
            *("--prompt", f"{document}\nWhich box holds item 4?", "--max-tokens", "3"),
            *("--method", "kvzip", "--budget", "64", "--chat", "--json"),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["method"] == "kvzip" and report["config"]["budget"] == 64
    run = report["runs"][0]
    assert run["document_tokens"] > 64 and run["kvzip_scored_tokens"] > run["document_tokens"]
    # One threshold over every layer (allocation "global"): a layer may keep more than 64 rows
    # per head, but fewer than the document, and the whole cache is compressed.
    assert run["tokens_kept_per_layer"] < run["document_tokens"] + run["prompt_tokens"] + 3
    assert run["compression_ratio"] > 1.0


def test_lanes_need_the_hook(tiny_model: Any, tiny_tokenizer: Any) -> None:
    """A cut across heads holds lanes only the hook attends: a call whose attention never
    came back through the hook (a model computing attention by hand) is refused at the next
    use of the cache instead of going on silently."""
    model = tiny_model("mistral")
    caches = zipped(model, tiny_tokenizer, context(seed=4), kvzip_allocation="head")
    cache = caches[0]
    assert cache.policy_state.lanes is not None
    B, H, _, D = cache.policy_state.keys.shape
    new = mx.zeros((B, H, 1, D))
    cache.update_and_fetch(new, new)  # what a hand-written attention does: no attend() call
    with pytest.raises(RuntimeError, match="only the attention hook"):
        cache.update_and_fetch(new, new)
    # Through the hook the same cut answers as usual.
    fresh = zipped(model, tiny_tokenizer, context(seed=4), kvzip_allocation="head")
    assert len(answer(model, fresh, [3, 4, 5])) == 6
