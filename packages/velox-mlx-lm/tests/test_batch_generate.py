"""Batched Velox caches under mlx-lm's BatchGenerator (velox_mlx_lm.batch_cache).

Row equivalence on tiny random models: every sequence of a batch (prompts of different
lengths, right-padded by mlx-lm, prefilled in several chunks) gets the same greedy tokens,
logits (within float32 tolerance) and kept positions on every layer as the same sequence
generated alone with the same config; rows that finish early, rows inserted while others
decode, per-step budgets, extract / merge / save round trips, and the errors.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_cache_core import POLICIES
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, methods
from velox_mlx_lm.batch_cache import BatchVeloxKVCache
from velox_mlx_lm.cache import PolicyKVCache

METHODS = tuple(m for m in methods() if m != "full")
BUDGET = 8
STEP = 8  # prefill_step_size: prompts longer than this are prefilled in several chunks
PROMPTS = (21, 5, 13, 30)  # lengths: shorter and longer than the budget and the step


def config(method: str, budget: int = BUDGET) -> KVCacheConfig:
    policy = "tova" if method.startswith("tova") else method
    fields: dict[str, Any] = {f"{policy}_budget": budget}
    if method == "snapkv":
        fields["snapkv_window"] = 3
    if method == "morphkv":
        fields["morphkv_window"] = 3
    if method in ("h2o", "morphkv", "streaming_llm", "kvzip"):
        fields[f"{policy}_n_sink"] = 1
    if method == "kvzip":
        fields["kvzip_probe"] = "latest"  # cut at the prompt's end, with no extra pass
    return KVCacheConfig(method=method, **fields)


def prompts(lengths=PROMPTS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=n).tolist() for n in lengths]


def alone(model, cfg, prompt: list[int], steps: int):
    """generate_step's schedule for one sequence: prefill all but the last token in chunks of
    STEP, then greedy steps. Returns (tokens, log-probabilities, caches after the last token)."""
    cache = KVCacheBuilder.for_model(model, cfg)
    tokens = mx.array(prompt)
    start, n = 0, len(prompt)
    while n - start > 1:
        size = min(STEP, n - 1 - start)
        model(tokens[None, start : start + size], cache=cache)
        mx.eval([c.state for c in cache])
        start += size
    y, out, logprobs = tokens[None, start:], [], []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        lp = logits - mx.logsumexp(logits, keepdims=True)
        y = mx.argmax(lp, axis=-1)[:, None]
        out.append(y.item())
        logprobs.append(np.array(lp[0]))
    model(y, cache=cache)  # BatchGenerator feeds the last token before it extracts the cache
    mx.eval([c.state for c in cache])
    return out, logprobs, cache


def batched(model, cfg, items, *, late=(), after: int = 3, check=None):
    """Run BatchGenerator (greedy) over ``items`` = [(prompt, max_tokens)], inserting ``late``
    ones after ``after`` steps. Returns {index: (tokens, logprobs, extracted caches)}."""
    model.make_cache = lambda: KVCacheBuilder.for_model(model, cfg)
    gen = BatchGenerator(model, max_tokens=64, prefill_step_size=STEP, prefill_batch_size=4)
    out: dict[int, Any] = {}
    try:
        uids = gen.insert([p for p, _ in items], [m for _, m in items])
        index = {u: i for i, u in enumerate(uids)}
        results: dict[int, tuple[list, list, Any]] = {i: ([], [], None) for i in index.values()}
        steps = 0
        while True:
            if steps == after and late:
                new = gen.insert([p for p, _ in late], [m for _, m in late])
                for j, u in enumerate(new):
                    index[u] = len(items) + j
                    results[len(items) + j] = ([], [], None)
            responses = gen.next_generated()
            if not responses:
                break
            steps += 1
            for r in responses:
                tokens, lps, _ = results[index[r.uid]]
                tokens.append(r.token)
                lps.append(np.array(r.logprobs))
                if r.finish_reason is not None:
                    results[index[r.uid]] = (tokens, lps, r.prompt_cache)
            if check is not None:
                check(gen)
        out = results
    finally:
        gen.close()
        del model.make_cache
    return out


def positions(cache: Any) -> list[np.ndarray]:
    """Sorted kept positions [H_kv, n] per layer (Velox layers only)."""
    return [
        np.sort(np.array(c.positions)[0], axis=-1)
        for c in cache
        if isinstance(c, PolicyKVCache) and c.positions is not None
    ]


def assert_same_as_alone(model, cfg, items, results) -> None:
    for i, (prompt, steps) in enumerate(items):
        tokens, logprobs, cache = alone(model, cfg, prompt, steps)
        got_tokens, got_lps, got_cache = results[i]
        assert got_tokens == tokens, f"sequence {i}"
        np.testing.assert_allclose(np.stack(got_lps), np.stack(logprobs), atol=2e-4, rtol=1e-4)
        assert [c.offset for c in got_cache] == [c.offset for c in cache]
        for got, want in zip(positions(got_cache), positions(cache), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_batch_rows_equal_sequences_alone(tiny_model, method):
    model = tiny_model("mistral", fresh=True)
    cfg = config(method)
    items = [(p, 6) for p in prompts()]
    packed = []

    def check(gen) -> None:
        for c in gen._generation_batch.prompt_cache:
            if isinstance(c, BatchVeloxKVCache):
                packed.append(c.batch.packed is not None)

    assert_same_as_alone(model, cfg, items, batched(model, cfg, items, check=check))
    # Policies that pack rows decode packed once every row has evicted (and so the equality
    # above covered the packed steps); the others never pack.
    assert any(packed) == POLICIES[cfg.policy].packs_rows


@pytest.mark.parametrize("method", ["tova", "streaming_llm"])
def test_rows_below_the_budget_decode_padded_then_alone(tiny_model, method):
    """Short rows of different lengths decode packed with padding until the longest would
    evict, then each row alone until all have evicted, then packed again: each row still
    equals its sequence alone."""
    model = tiny_model("llama", fresh=True)
    cfg = config(method, budget=16)
    items = [(p, 20) for p in prompts((3, 7, 5), seed=4)]
    padded, alike = [], []

    def check(gen) -> None:
        for c in gen._generation_batch.prompt_cache:
            if isinstance(c, BatchVeloxKVCache) and c.batch.packed is not None:
                (padded if c.batch.packed.padded else alike).append(True)
                assert c.tokens_kept == c.batch.packed.tokens_kept

    assert_same_as_alone(model, cfg, items, batched(model, cfg, items, check=check))
    assert padded and alike


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("method", ["tova", "h2o"])
def test_batch_rows_equal_sequences_alone_across_archs(tiny_model, arch, method):
    model = tiny_model(arch, fresh=True)
    cfg = config(method)
    items = [(p, 5) for p in prompts((17, 4, 26), seed=1)]
    assert_same_as_alone(model, cfg, items, batched(model, cfg, items))


def test_layers_keep_different_rows_and_attention_stays_exact(tiny_model):
    """Head-scope TOVA evicts different tokens on every layer and head, so the mask the model
    builds from one layer's cache would be wrong for the others: each layer's rows attend with
    their own masks and the logits still equal the sequences' alone."""
    model = tiny_model("mistral", fresh=True)
    cfg = KVCacheConfig(method="tova", tova_budget=6, tova_scope="head", tova_n_sink=0)
    items = [(p, 8) for p in prompts((23, 9, 15), seed=2)]
    results = batched(model, cfg, items)
    kept = positions(results[0][2])
    assert (
        any(not np.array_equal(kept[0], k) for k in kept[1:])
        or len({tuple(r) for r in kept[0]}) > 1
    )
    assert_same_as_alone(model, cfg, items, results)


def test_early_finish_late_insert_and_budget_after_every_step(tiny_model):
    model = tiny_model("llama", fresh=True)
    cfg = config("tova")
    items = [(p, m) for p, m in zip(prompts((19, 6, 11)), (9, 2, 5), strict=True)]
    late = [(p, 6) for p in prompts((14, 25), seed=3)]
    seen = []

    packed = []

    def check(gen) -> None:
        for c in gen._generation_batch.prompt_cache:
            if isinstance(c, BatchVeloxKVCache):
                assert all(n <= BUDGET for n in c.tokens_kept)
                seen.append(len(c))
                packed.append(c.batch.packed is not None)

    results = batched(model, cfg, items, late=late, after=2, check=check)
    assert max(seen) >= 3 and min(seen) == 1  # rows joined and left
    assert any(packed)  # and in between, rows decoded packed, unpacking for every change
    assert_same_as_alone(model, cfg, items + late, results)


def test_batch_generate_with_velox_caches(tiny_model, tiny_tokenizer):
    model = tiny_model("llama", fresh=True)
    cfg = config("tova")
    model.make_cache = lambda: KVCacheBuilder.for_model(model, cfg)
    ps = prompts((12, 20, 7), seed=4)
    response = batch_generate(
        model, tiny_tokenizer, ps, max_tokens=4, return_token_ids=True, prefill_step_size=STEP
    )
    for prompt, ids in zip(ps, response.token_ids, strict=True):
        want, _, _ = alone(model, cfg, prompt, 4)
        stop = [i for i, t in enumerate(want) if t in tiny_tokenizer.eos_token_ids]
        assert ids == want[: stop[0]] if stop else ids == want


def test_extracted_caches_merge_again_and_round_trip_through_files(tiny_model, tmp_path):
    model = tiny_model("llama", fresh=True)
    cfg = config("h2o")
    items = [(p, 4) for p in prompts((16, 9), seed=5)]
    results = batched(model, cfg, items)
    extracted = results[0][2]
    path = str(tmp_path / "row.safetensors")
    save_prompt_cache(path, extracted)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in extracted]
    for a, b in zip(positions(loaded), positions(extracted), strict=True):
        np.testing.assert_array_equal(a, b)
    # The loaded row continues like the extracted one, alone or merged into a new batch.
    merged = [type(a).merge([a, b]) for a, b in zip(loaded, results[1][2], strict=True)]
    assert all(isinstance(c, BatchVeloxKVCache) and len(c) == 2 for c in merged)
    assert [int(o) for o in np.array(merged[0].offset)] == [
        extracted[0].offset,
        results[1][2][0].offset,
    ]
    token = mx.array([[3], [4]])
    logits = model(token, cache=merged)
    single = model(token[:1], cache=copy.deepcopy(extracted))
    np.testing.assert_allclose(np.array(logits[0]), np.array(single[0]), atol=1e-4)


def test_merge_filter_extend_extract_errors_leave_caches_unchanged(tiny_model, h):
    model = tiny_model("llama")
    a = KVCacheBuilder.for_model(model, config("tova"))
    b = KVCacheBuilder.for_model(model, config("tova", budget=9))
    c = KVCacheBuilder.for_model(model, config("h2o"))
    h.forward_chunks(model, a, h.random_tokens(12), [12])
    with pytest.raises(ValueError, match="budget: 8 != 9"):
        type(a[0]).merge([a[0], b[0]])
    with pytest.raises(ValueError, match="policy state: tova != h2o"):
        type(a[0]).merge([a[0], c[0]])
    with pytest.raises(TypeError, match="Velox cache"):
        type(a[0]).merge([a[0], object()])
    assert a[0].offset == 12 and a[0].size() == BUDGET and b[0].empty()
    batch = type(a[0]).merge([a[0], KVCacheBuilder.for_model(model, config("tova"))[0]])
    with pytest.raises(IndexError, match="batch index 2 out of range for a batch of 2"):
        batch.extract(2)
    with pytest.raises(IndexError):
        batch.filter([0, 3])
    other = type(b[0]).merge([b[0]])
    with pytest.raises(ValueError, match="budget"):
        batch.extend(other)
    assert len(batch) == 2 and [int(o) for o in np.array(batch.offset)] == [12, 0]
    with pytest.raises(ValueError, match="lengths must have one entry per row"):
        batch.prepare(lengths=[1], right_padding=[0])
    # the batch still works
    batch.filter([1, 0])
    assert [int(o) for o in np.array(batch.offset)] == [0, 12]
    assert batch.extract(1).offset == 12 and batch.extract(-1).offset == 12


def test_extracted_row_of_packed_rows_holds_only_its_own_bytes():
    """A finished sequence's cache (what the server's prompt cache keeps) is extracted from
    packed rows; it must not keep the other rows' buffers alive behind its ``nbytes``."""
    import gc

    from velox_mlx_lm.cache import TOVAKVCache

    H, D, budget, B = 8, 128, 1024, 4
    gc.collect()
    base = mx.get_active_memory()
    rows = []
    for b in range(B):
        row = TOVAKVCache(budget=budget)
        k = mx.random.normal((1, H, budget + 64, D), key=mx.random.key(b))
        row.update_and_fetch(k, k)
        row.attend(mx.random.normal((1, 2 * H, budget + 64, D)), D**-0.5, None, None)
        mx.eval(row.policy_state.slots.arrays())
        rows.append(row)
    batch = BatchVeloxKVCache.merge(rows)
    k = mx.random.normal((B, H, 1, D))
    batch.update_and_fetch(k, k)
    mx.eval(batch.attend(mx.random.normal((B, 2 * H, 1, D)), D**-0.5, None, None))
    assert batch.batch.packed is not None
    kept = batch.extract(0)
    mx.eval(kept.policy_state.slots.arrays())
    del rows, row, batch, k
    gc.collect()
    held = mx.get_active_memory() - base
    # Its own rows (and small undo entries), not the B rows' packed buffers.
    assert kept.nbytes // 2 < held < 2 * kept.nbytes, (held, kept.nbytes)


def test_batched_cache_needs_the_hook(tiny_model):
    model = tiny_model("llama")
    cfg = config("tova")
    rows = [KVCacheBuilder.for_model(model, cfg)[0] for _ in range(2)]
    batch = type(rows[0]).merge(rows)
    k = mx.zeros((2, 4, 3, 8))
    batch.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="attention hook"):
        batch.update_and_fetch(k, k)


def test_left_padding_is_never_stored_or_attended(tiny_model, h):
    """prepare(left_padding=...) (mlx-lm's BatchKVCache convention) works too: the padding
    before a row's tokens is skipped and its offset starts at the first real token."""
    model = tiny_model("llama", fresh=True)
    cfg = config("tova")
    caches = [KVCacheBuilder.for_model(model, cfg) for _ in range(2)]
    merged = [type(c0).merge([c0, c1]) for c0, c1 in zip(*caches, strict=True)]
    p = prompts((10, 6), seed=6)
    for c in merged:
        c.prepare(left_padding=[0, 4])
    assert [int(o) for o in np.array(merged[0].offset)] == [0, -4]
    tokens = mx.array([p[0], [0] * 4 + p[1]])
    logits = model(tokens, cache=merged)
    for c in merged:
        c.finalize()
    assert [int(o) for o in np.array(merged[0].offset)] == [10, 6]
    assert merged[0].tokens_kept == [BUDGET, 6]
    solo = KVCacheBuilder.for_model(model, cfg)
    want = model(mx.array([p[1]]), cache=solo)
    np.testing.assert_allclose(np.array(logits[1, 4:]), np.array(want[0]), atol=1e-4)


EMBEDDED_TEXTS = (
    "The Roman Empire grew out of the Roman Republic. Its emperors ruled lands around the "
    "Mediterranean Sea for centuries, and its roads, laws and language shaped Europe. " * 2,
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. "
    "It happens in the chloroplasts of leaf cells, which hold the green pigment chlorophyll. "
    "Without it there would be almost no oxygen in the air we breathe. " * 3,
    "The sea.",
)


@pytest.mark.model
@pytest.mark.slow
def test_embedded_model_batch_equals_each_prompt_alone(embedded_model_path: Any) -> None:
    """The embedded SmolLM2: three chat prompts of different lengths (about 40 to 190 tokens)
    through batch_generate with TOVA(32), greedy, 32 new tokens each, equal the tokens of
    each prompt generated alone through generate_step with the same config. Every prompt is
    longer than the budget, so every row evicts during prefill and at every decode step, and
    every cache stays within its budget."""
    from mlx_lm.generate import generate_step

    from velox_mlx_lm.embedded import load_default

    model, tokenizer = load_default()
    cfg = KVCacheConfig(method="tova", tova_budget=32)
    ps = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text + " Explain this in detail."}],
            add_generation_prompt=True,
        )
        for text in EMBEDDED_TEXTS
    ]
    assert min(len(p) for p in ps) < 64 < max(len(p) for p in ps)
    tokens = 32
    model.make_cache = lambda: KVCacheBuilder.for_model(model, cfg)
    try:
        response = batch_generate(
            model, tokenizer, ps, max_tokens=tokens, return_token_ids=True, prefill_step_size=64
        )
    finally:
        del model.make_cache
    for prompt, ids in zip(ps, response.token_ids, strict=True):
        caches = KVCacheBuilder.for_model(model, cfg)
        want: list[int] = []
        for token, _ in generate_step(
            mx.array(prompt), model, prompt_cache=caches, max_tokens=tokens, prefill_step_size=64
        ):
            if int(token) in tokenizer.eos_token_ids:
                break
            want.append(int(token))
        assert len(want) == tokens, "the test needs answers that do not stop early"
        assert ids == want
        assert all(c.tokens_kept <= 32 for c in caches)
