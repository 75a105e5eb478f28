"""Adaptive allocation keeps the memory a budget promises (issue 34): on the embedded model, at
budgets of at least 64 and in every allocation mode, the bytes held (``nbytes``, and the MLX
active memory the caches take) are at most 1.05x the uniform cut's at the same budget."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.compress import compress, prefill

PROMPT_TOKENS = 600
MODES = {"kvzip": ("uniform", "head", "global"), "snapkv": ("uniform", "head")}


@pytest.fixture(scope="module")
def embedded(embedded_model_path: Any) -> tuple[Any, Any, list[int]]:
    from velox_mlx_lm.embedded import load

    model, tokenizer = load()
    words = "The committee met on Tuesday to review the budget, the roads and the schools. "
    tokens = tokenizer.encode(words * 60)[:PROMPT_TOKENS]
    assert len(tokens) == PROMPT_TOKENS
    return model, tokenizer, tokens


def _held(model: Any, tokenizer: Any, tokens: list[int], method: str, budget: int, mode: str):  # type: ignore[no-untyped-def]
    """(sum of nbytes, MLX active memory taken) of a cut cache, per-head counts per layer."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    settings = {f"{method}_budget": budget, f"{method}_allocation": mode}
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **settings))
    prefill(model, caches, tokens)
    if method == "kvzip":
        compress(model, tokenizer, caches, tokens)
    else:
        for c in caches:
            c.layer.end_prompt()
    mx.eval([c.state for c in caches])
    gc.collect()
    mx.clear_cache()
    taken = mx.get_active_memory() - before
    held = sum(c.nbytes for c in caches)
    counts = [
        None if c.policy_state.lanes is None else c.policy_state.lanes.counts(3).tolist()
        for c in caches
    ]
    del caches
    return held, taken, counts


@pytest.mark.parametrize("budget", [64, 128])
@pytest.mark.parametrize("method", sorted(MODES))
def test_every_mode_holds_at_most_the_uniform_bytes(
    embedded: tuple[Any, Any, list[int]], method: str, budget: int
) -> None:
    model, tokenizer, tokens = embedded
    results = {
        mode: _held(model, tokenizer, tokens, method, budget, mode) for mode in MODES[method]
    }
    uniform_held, uniform_taken, _ = results["uniform"]
    for mode, (held, taken, counts) in results.items():
        assert held <= 1.05 * uniform_held, (mode, held, uniform_held)
        assert taken <= 1.05 * uniform_taken, (mode, taken, uniform_taken)
        if mode != "uniform":  # the heads really keep different counts
            assert len({c for layer in counts for row in layer for c in row}) > 1
