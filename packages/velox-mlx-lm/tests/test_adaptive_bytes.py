"""Adaptive allocation keeps the memory a budget promises (issue 34): at budgets of at least 64
and in every allocation mode, the bytes a cut cache holds (``nbytes``, and the MLX active memory
freed when the caches go) are at most 1.05x the uniform cut's at the same budget."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.compress import compress, prefill

PROMPT_TOKENS = 400
MODES = {"kvzip": ("uniform", "head", "global"), "snapkv": ("uniform", "head")}


def _held(model: Any, tokenizer: Any, tokens: list[int], method: str, budget: int, mode: str):  # type: ignore[no-untyped-def]
    """(sum of nbytes, MLX active memory the caches free, per-head row counts) of a cut."""
    settings = {f"{method}_budget": budget, f"{method}_allocation": mode}
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **settings))
    prefill(model, caches, tokens)
    if method == "kvzip":
        compress(model, tokenizer, caches, tokens)
    else:
        for c in caches:
            c.layer.end_prompt()
    mx.eval([c.state for c in caches])
    heads = int(caches[0].policy_state.slots.positions.shape[1])
    held = sum(c.nbytes for c in caches)
    counts = [
        [] if c.policy_state.lanes is None else c.policy_state.lanes.counts(heads).tolist()
        for c in caches
    ]
    gc.collect()
    mx.clear_cache()
    with_caches = mx.get_active_memory()
    del caches
    gc.collect()
    mx.clear_cache()
    return held, with_caches - mx.get_active_memory(), counts


@pytest.mark.parametrize("budget", [64, 128])
@pytest.mark.parametrize("method", sorted(MODES))
def test_every_mode_holds_at_most_the_uniform_bytes(
    tiny_model: Any, tiny_tokenizer: Any, method: str, budget: int
) -> None:
    model = tiny_model("llama")
    tokens = np.random.default_rng(budget).integers(2, 128, PROMPT_TOKENS).tolist()
    results = {m: _held(model, tiny_tokenizer, tokens, method, budget, m) for m in MODES[method]}
    uniform_held, uniform_freed, _ = results["uniform"]
    # What the caches free is their rows plus what every mode holds alike besides them (the
    # layers' bookkeeping); a mode that padded its heads would show here as in nbytes.
    assert uniform_freed >= uniform_held > 0
    for mode, (held, freed, counts) in results.items():
        assert held <= 1.05 * uniform_held, (mode, held, uniform_held)
        assert freed <= 1.05 * uniform_freed, (mode, freed, uniform_freed)
        if mode != "uniform":  # the heads really keep different counts
            assert len({c for layer in counts for row in layer for c in row}) > 1, mode
