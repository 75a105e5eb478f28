"""``KVCacheConfig(positions="compact")``: RoPE distances kept inside the model's context.

The reference (:class:`FollowCache`) is written from scratch: it keeps every token's key
un-rotated and, at each decode step, attends over the rows the Velox cache kept (read off the
Velox cache before the step) plus the new token, each key rotated once from its un-rotated form
at the position the compaction rule gives it. The Velox cache instead rotates the stored keys
again at every shift; both must give the same logits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from conftest import random_tokens
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.cache import PolicyKVCache

CONTEXT, BUDGET, SINKS = 40, 16, 4


def _rope_of(model: Any, i: int) -> Any:
    return model.layers[i].self_attn.rope


class FollowCache:
    """A decode-only reference cache (one token per call) that keeps un-rotated keys and
    lays the kept rows out as compact positions say (see the module doc)."""

    def __init__(self, rope: Any, drop_oldest: bool = False) -> None:
        self.rope = rope
        # StreamingLLM frees its oldest non-sink before the new token attends, when full
        self.drop_oldest = drop_oldest
        self.raw: dict[int, mx.array] = {}  # token -> [H, D] un-rotated key
        self.values: dict[int, mx.array] = {}
        self.at: dict[tuple[int, int], int] = {}  # (head, token) -> RoPE position
        self.offset = 0  # read by the model: the RoPE position of the next token
        self.token = 0
        self.kept: np.ndarray = np.zeros((0, 0), dtype=np.int64)  # [H, n]: see prepare
        self.max_distance = 0

    def prepare(self, kept: np.ndarray) -> None:
        """Before a step (before the model reads ``offset``): the rows the Velox cache kept
        ``[H, n]``; shift when the next token would reach the context."""
        if self.drop_oldest and kept.size and kept.shape[1] >= BUDGET:
            oldest = np.where(kept >= SINKS, kept, kept.max() + 1).min(axis=1)
            kept = np.stack([row[row != o] for row, o in zip(kept, oldest, strict=True)])
        self.kept = kept
        if self.offset + 1 > CONTEXT:
            self._shift()

    def _shift(self) -> None:
        for h in range(self.kept.shape[0]):
            movable = sorted(int(t) for t in self.kept[h] if t >= SINKS)
            for i, t in enumerate(movable):
                self.at[(h, t)] = BUDGET - len(movable) + i
        self.offset = BUDGET

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        assert keys.shape[0] == 1 and keys.shape[2] == 1
        H = keys.shape[1]
        rope = self.rope
        raw = mx.fast.rope(
            keys[0],
            rope.dims,
            traditional=rope.traditional,
            base=rope.base,
            scale=rope.scale,
            offset=-self.offset,
        )  # back to position 0
        t = self.token
        self.raw[t], self.values[t] = raw[:, 0], values[0, :, 0]
        for h in range(H):
            self.at[(h, t)] = self.offset
        rows = (
            np.concatenate([self.kept, np.full((H, 1), t)], axis=1)
            if self.kept.size
            else (np.full((H, 1), t))
        )
        ks, vs = [], []
        for h in range(H):
            where = np.array([self.at[(h, int(s))] for s in rows[h]])
            self.max_distance = max(self.max_distance, int(self.offset - where.min()))
            raw_rows = mx.stack([self.raw[int(s)][h] for s in rows[h]])[:, None, :]
            ks.append(
                mx.fast.rope(
                    raw_rows,
                    rope.dims,
                    traditional=rope.traditional,
                    base=rope.base,
                    scale=rope.scale,
                    offset=mx.array(where, dtype=mx.int32),
                )[:, 0]
            )
            vs.append(mx.stack([self.values[int(s)][h] for s in rows[h]]))
        self.offset += 1
        self.token += 1
        return mx.stack(ks)[None], mx.stack(vs)[None]

    def make_mask(self, N: int, return_array: bool = False, window_size: Any = None) -> Any:
        return None

    @property
    def state(self) -> list[Any]:
        return []


def _config(method: str, positions: str = "compact", **extra: Any) -> KVCacheConfig:
    policy = {"tova": "tova", "h2o": "h2o", "streaming_llm": "streaming_llm"}[method]
    fields = {f"{policy}_budget": BUDGET, f"{policy}_n_sink": SINKS, **extra}
    return KVCacheConfig(method=method, positions=positions, context=CONTEXT, **fields)


def _decode(model: Any, caches: list[Any], tokens: mx.array) -> mx.array:
    logits = model(tokens, cache=caches)[0]
    mx.eval(logits, [c.state for c in caches])
    return logits


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_compact_decode_equals_the_rerotating_reference(
    tiny_model: Any, arch: str, method: str
) -> None:
    model = tiny_model(arch)
    caches = KVCacheBuilder.for_model(model, _config(method))
    refs = [
        FollowCache(_rope_of(model, i), drop_oldest=method == "streaming_llm")
        for i in range(len(model.layers))
    ]
    tokens = random_tokens(100, seed=3)
    shifts_seen = 0
    for t in range(tokens.shape[1]):
        for c, r in zip(caches, refs, strict=True):
            kept = c.positions
            r.prepare(np.zeros((0, 0), dtype=np.int64) if kept is None else np.array(kept[0]))
        assert caches[0].offset < CONTEXT  # the next token's RoPE position stays inside
        got = _decode(model, caches, tokens[:, t : t + 1])
        want = _decode(model, refs, tokens[:, t : t + 1])
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-4, rtol=1e-4)
        assert len({c.offset for c in caches}) == 1  # every layer reads the same offset
        assert all(c.token_offset == t + 1 for c in caches)
        shifts_seen = caches[0].compaction.shifts
    assert shifts_seen >= 3
    assert max(r.max_distance for r in refs) < CONTEXT


@pytest.mark.parametrize("method", ["tova", "streaming_llm"])
def test_compact_equals_absolute_until_the_first_shift(tiny_model: Any, method: str) -> None:
    model = tiny_model("mistral")
    tokens = random_tokens(CONTEXT + 6, seed=5)
    out = {}
    for positions in ("absolute", "compact"):
        caches = KVCacheBuilder.for_model(model, _config(method, positions))
        prompt = _decode(model, caches, tokens[:, :30])
        steps = [_decode(model, caches, tokens[:, t : t + 1]) for t in range(30, CONTEXT)]
        after = _decode(model, caches, tokens[:, CONTEXT : CONTEXT + 1])
        out[positions] = (prompt, steps, after, caches[0].offset)
    a, c = out["absolute"], out["compact"]
    np.testing.assert_array_equal(np.array(a[0]), np.array(c[0]))  # bit for bit
    for x, y in zip(a[1], c[1], strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert a[3] == CONTEXT + 1 and c[3] == BUDGET + 1  # the shift came with the last token


def test_compact_chunks_shift_before_the_chunk(tiny_model: Any) -> None:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, _config("tova"))
    tokens = random_tokens(120, seed=7)
    for start in range(0, 120, 8):
        assert caches[0].offset + 8 <= CONTEXT or caches[0].compaction.lag == 0 or True
        logits = _decode(model, caches, tokens[:, start : start + 8])
        assert bool(mx.all(mx.isfinite(logits)))
        assert caches[0].offset <= CONTEXT
    assert caches[0].compaction.shifts >= 3
    assert caches[0].token_offset == 120


def test_absolute_is_unchanged(tiny_model: Any) -> None:
    model = tiny_model("llama")
    tokens = random_tokens(60, seed=2)
    runs = []
    for config in (
        KVCacheConfig(method="tova", tova_budget=BUDGET),
        KVCacheConfig(method="tova", tova_budget=BUDGET, positions="absolute"),
    ):
        caches = KVCacheBuilder.for_model(model, config)
        runs.append([_decode(model, caches, tokens[:, t : t + 1]) for t in range(60)])
        assert caches[0].offset == caches[0].token_offset == 60
        assert caches[0].positions_mode == "absolute"
    for x, y in zip(*runs, strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_prompt_file_round_trip_and_trims(tiny_model: Any, tmp_path: Any) -> None:
    model = tiny_model("mistral")
    config = _config("tova", tova_signal="query")
    caches = KVCacheBuilder.for_model(model, config)
    tokens = random_tokens(80, seed=9)
    for t in range(70):
        _decode(model, caches, tokens[:, t : t + 1])
    comp = caches[0].compaction
    assert comp is not None and comp.shifts >= 1
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert isinstance(loaded[0], PolicyKVCache) and loaded[0].positions_mode == "compact"
    assert loaded[0].offset == caches[0].offset and loaded[0].token_offset == 70
    assert loaded[0].compaction.scalars() == comp.scalars()
    from velox_mlx_lm import load_prompt_cache as velox_load

    assert velox_load(path, config)[0].positions_mode == "compact"
    with pytest.raises(ValueError, match="saved with positions='compact'"):
        velox_load(path, config.replace(positions="absolute"))
    for t in range(70, 80):  # the loaded cache continues exactly as the original
        a = _decode(model, caches, tokens[:, t : t + 1])
        b = _decode(model, loaded, tokens[:, t : t + 1])
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # a trim after the shift restores the state exactly
    since = caches[0].token_offset - caches[0].compaction.shifted_at
    assert since >= 3
    before = [np.array(c.positions) for c in caches]
    offset = caches[0].offset
    _decode(model, caches, tokens[:, :2])
    for c in caches:
        assert c.trim(2) == 2
    assert caches[0].offset == offset
    for c, p in zip(caches, before, strict=True):
        np.testing.assert_array_equal(np.array(c.positions), p)


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_a_trim_past_a_shift_restores_the_state_before_it(tiny_model: Any, method: str) -> None:
    """Speculative decoding trims the last drafts; when a shift came among them, the trim
    undoes it: the cache equals one that never saw the trimmed tokens."""
    model = tiny_model("mistral")
    tokens = random_tokens(80, seed=11)
    config = _config(method)
    for fed, n in ((42, 3), (41, 1), (64, 1), (65, 4), (66, 2)):
        caches = KVCacheBuilder.for_model(model, config)
        for t in range(fed):
            _decode(model, caches, tokens[:, t : t + 1])
        assert caches[0].compaction.shifts >= 1
        assert caches[0].trimmable_tokens >= n
        for c in caches:
            assert c.trim(n) == n
        want = KVCacheBuilder.for_model(model, config)
        for t in range(fed - n):
            _decode(model, want, tokens[:, t : t + 1])
        for got, ref in zip(caches, want, strict=True):
            assert (got.offset, got.token_offset) == (ref.offset, ref.token_offset)
            assert got.compaction.scalars() == ref.compaction.scalars()
            np.testing.assert_array_equal(np.array(got.positions), np.array(ref.positions))
            np.testing.assert_allclose(np.array(got.keys), np.array(ref.keys), atol=1e-5)
        for t in range(fed - n, fed - n + 5):  # and continues as it does
            a = _decode(model, caches, tokens[:, t : t + 1])
            b = _decode(model, want, tokens[:, t : t + 1])
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    # a chunk the shift falls inside (a verify chunk crossing the context) runs as two calls
    # around it, so trims of any part of it are exact too
    for n, shifted in ((6, 0), (2, 1), (3, 0), (1, 1)):
        caches = KVCacheBuilder.for_model(model, config)
        for t in range(36):
            _decode(model, caches, tokens[:, t : t + 1])
        _decode(model, caches, tokens[:, 36:42])
        assert caches[0].compaction.shifts == 1 and caches[0].compaction.shifted_at == 40
        for c in caches:
            c.trim(n)
        want = KVCacheBuilder.for_model(model, config)
        for t in range(42 - n):
            _decode(model, want, tokens[:, t : t + 1])
        assert caches[0].compaction.shifts == shifted
        for got, ref in zip(caches, want, strict=True):
            assert (got.offset, got.token_offset) == (ref.offset, ref.token_offset)
            np.testing.assert_array_equal(np.array(got.positions), np.array(ref.positions))
            np.testing.assert_allclose(np.array(got.keys), np.array(ref.keys), atol=1e-5)
    # past the undo window after a shift, a trim cannot reach back past it
    caches = KVCacheBuilder.for_model(model, config.replace(trim_window=4))
    for t in range(47):
        _decode(model, caches, tokens[:, t : t + 1])
    assert caches[0].trimmable_tokens == 4
    with pytest.raises(ValueError, match=r"cannot trim 5 tokens"):
        caches[0].trim(5)


def test_compact_refusals(tiny_model: Any) -> None:
    with pytest.raises(ValueError, match="positions must be one of"):
        KVCacheConfig(method="tova", positions="relative")
    with pytest.raises(ValueError, match="positions='compact' supports"):
        KVCacheConfig(method="snapkv", positions="compact")
    with pytest.raises(ValueError, match="kv_key_layout='token'"):
        KVCacheConfig(method="tova", positions="compact", kv_bits=4, kv_key_layout="channel")
    with pytest.raises(ValueError, match="allocation='uniform'"):
        KVCacheConfig(method="tova", positions="compact", tova_allocation="head", tova_scope="head")
    model = tiny_model("llama", fresh=True)
    from mlx_lm.models.rope_utils import Llama3RoPE

    model.layers[1].self_attn.rope = Llama3RoPE(
        8, 2048, False, 10_000.0, {"factor": 8.0, "original_max_position_embeddings": 256}
    )
    with pytest.raises(ValueError, match=r"layer 1 has a Llama3RoPE; positions='compact'"):
        KVCacheBuilder.for_model(model, _config("tova"))
    assert KVCacheConfig(method="full", positions="compact").positions == "compact"
    with pytest.raises(ValueError, match=r"budget .* below the model.s context"):
        KVCacheBuilder.for_model(model, _config("tova").replace(context=BUDGET))


def test_gemma3_sliding_layers_keep_their_caches(tiny_model: Any) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_model("gemma3")
    caches = KVCacheBuilder.for_model(
        model, KVCacheConfig(method="tova", positions="compact", context=24, tova_budget=8)
    )
    assert isinstance(caches[0], RotatingKVCache) and isinstance(caches[2], PolicyKVCache)
    tokens = random_tokens(60, seed=1)
    for t in range(60):
        logits = _decode(model, caches, tokens[:, t : t + 1])
        assert bool(mx.all(mx.isfinite(logits)))
        assert caches[2].offset < 24 + 1
    assert caches[2].compaction.shifts >= 2


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_batch_generator_rows_equal_sequences_alone(tiny_model: Any, method: str) -> None:
    """mlx-lm's BatchGenerator (right-padded prompts prefilled in chunks, a late insert): each
    row shifts at its own calls and equals the sequence generated alone."""
    from test_batch_generate import assert_same_as_alone, batched, config, prompts

    model = tiny_model("mistral", fresh=True)
    cfg = config(method).replace(positions="compact", context=27)  # shifts inside chunks
    items = list(zip(prompts(), (40, 30, 35, 25), strict=True))
    late = [(prompts((17,), seed=1)[0], 30)]
    results = batched(model, cfg, items, late=late)
    assert_same_as_alone(model, cfg, [*items, *late], results)
    shifted = [c.compaction.shifts for c in results[0][2] if isinstance(c, PolicyKVCache)]
    assert min(shifted) >= 2


def test_batch_refuses_mixed_positions(tiny_model: Any) -> None:
    model = tiny_model("llama")
    compact = KVCacheBuilder.for_model(model, _config("tova"))
    absolute = KVCacheBuilder.for_model(model, _config("tova", "absolute"))
    with pytest.raises(ValueError, match="mixes positions"):
        type(compact[0]).merge([compact[0], absolute[0]])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_shift_through_dequantize_rotate_quantize(bits: int) -> None:
    """Keys quantized per token are shifted by dequantize, rotate, quantize: past the shifts the
    quantized cache stays as close to the full-precision one as it does with absolute
    positions (StreamingLLM: the same rows are kept whatever the rounding)."""
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # quantized in groups of 32
        rms_norm_eps=1e-5,
        vocab_size=128,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    tokens = random_tokens(100, seed=4)
    errors = {}
    for positions in ("absolute", "compact"):
        runs = []
        for kv_bits in (None, bits):
            config = _config("streaming_llm", positions).replace(kv_bits=kv_bits, kv_group_size=32)
            caches = KVCacheBuilder.for_model(model, config)
            runs.append(
                np.stack(
                    [np.array(_decode(model, caches, tokens[:, t : t + 1])) for t in range(100)]
                )
            )
        errors[positions] = np.abs(runs[0] - runs[1])[CONTEXT:].max()
        if positions == "compact":
            assert caches[0].compaction.shifts >= 3
    assert errors["compact"] < 2.0 * errors["absolute"], errors


@pytest.mark.parametrize("method", ["tova", "streaming_llm"])
def test_speculative_decoding_with_compact_positions(tiny_model: Any, method: str) -> None:
    """mlx-lm's speculative decoding (verify chunks that split at the shift, trims of rejected
    drafts in the model's and the draft's caches): greedy output equals plain decoding."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    model, draft = tiny_model("mistral"), tiny_model("mistral", seed=1)
    prompt = random_tokens(20, seed=13)[0]
    plain_caches = KVCacheBuilder.for_model(model, _config(method))
    plain = [
        int(t) for t, _ in generate_step(prompt, model, prompt_cache=plain_caches, max_tokens=60)
    ]
    caches = KVCacheBuilder.for_model(model, _config(method))
    drafted = KVCacheBuilder.for_model(draft, _config(method))
    rounds = speculative_generate_step(
        prompt, model, draft, prompt_cache=caches + drafted, max_tokens=60, num_draft_tokens=3
    )
    spec = [int(token) for token, _, _ in rounds]
    assert spec == plain
    assert caches[0].compaction.shifts >= 2 and drafted[0].compaction.shifts >= 2
    assert all(c.offset < CONTEXT for c in caches + drafted)


@pytest.mark.parametrize(
    ("argv", "positions"),
    [
        ([], "absolute"),
        (["--beyond-context"], "compact"),
        (["--beyond-context", "--method", "streaming_llm"], "compact"),
        (["--beyond-context", "--positions", "absolute"], "absolute"),
        (["--positions", "compact"], "compact"),
        (["--beyond-context", "--method", "morphkv"], "absolute"),  # cannot shift
        (["--beyond-context", "--kv-bits", "4"], "absolute"),  # keys best per channel
        (["--beyond-context", "--kv-bits", "4", "--kv-key-layout", "token"], "compact"),
        (["--beyond-context", "--kv-bits", "8"], "compact"),
    ],
)
def test_serve_positions_default_follows_beyond_context(argv: list[str], positions: str) -> None:
    from velox_mlx_lm.serve.app import _check_args, build_parser

    config = _check_args(build_parser().parse_args(argv))
    assert config.positions == positions


def test_generate_takes_positions() -> None:
    from velox_mlx_lm.cli.app import _check_args, build_parser

    args = build_parser().parse_args(["--prompt", "hi", "--positions", "compact"])
    assert _check_args(args).positions == "compact"
    args = build_parser().parse_args(
        ["--prompt", "hi", "--method", "snapkv", "--positions", "compact"]
    )
    with pytest.raises(ValueError, match="positions='compact' supports"):
        _check_args(args)


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm"])
def test_pinned_rows_keep_their_positions_through_shifts(tiny_model: Any, method: str) -> None:
    """Pinned rows, like sinks, are never shifted: their stored keys (rotated at their first
    RoPE positions) stay byte for byte through the shifts, and every distance stays inside."""
    from velox_mlx_lm.pins import pin_span

    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(
        model, _config(method, h2o_recent=4) if method == "h2o" else _config(method)
    )
    pin_span(caches, 10, 14)
    tokens = random_tokens(110, seed=11)

    def pinned_keys(cache: PolicyKVCache) -> np.ndarray:
        state = cache.policy_state
        positions = np.array(state.positions)[0, 0]
        keys = np.array(state.keys.astype(mx.float32))[0, 0]
        return np.stack([keys[i] for i in np.argsort(positions) if 10 <= positions[i] < 14])

    _decode(model, caches, tokens[:, :20])
    before = [pinned_keys(c) for c in caches]
    for t in range(20, 110):
        _decode(model, caches, tokens[:, t : t + 1])
        assert caches[0].offset < CONTEXT
    assert caches[0].compaction.shifts >= 3
    for cache, keys in zip(caches, before, strict=True):
        np.testing.assert_array_equal(pinned_keys(cache), keys)


def test_stats_count_tokens_not_compacted_positions(tiny_model: Any) -> None:
    """Past a shift ``offset`` is the compacted position; the server's ``tokens_seen`` and the
    pinned tokens count tokens."""
    from velox_mlx_lm.pins import pin_span
    from velox_mlx_lm.serve.cache import kv_stats

    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, _config("tova"))
    pin_span(caches, 4, 8)
    tokens = random_tokens(60, seed=2)
    _decode(model, caches, tokens[:, :30])
    for t in range(30, 60):
        _decode(model, caches, tokens[:, t : t + 1])
    assert caches[0].offset < caches[0].token_offset == 60
    stats = kv_stats(caches)
    assert stats["tokens_seen"] == 60 and stats["pinned_tokens"] == 4
