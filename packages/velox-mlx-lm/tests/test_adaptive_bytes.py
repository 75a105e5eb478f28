"""Adaptive allocation keeps the memory a budget promises (issue 34): for every policy that has
the modes, at budgets of at least 64 and in every allocation mode, the bytes a cut cache holds
(``nbytes``, and the MLX active memory freed when the caches go) are at most 1.05x the uniform
cut's at the same budget."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.compress import compress, prefill

PROMPT_TOKENS = 400
SLACK = 16 * 1024  # bytes: allocator rounding of the tiny model's small arrays
MODES = {
    "expected_attention": ("uniform", "head", "global"),
    "kvzip": ("uniform", "head", "global"),
    "snapkv": ("uniform", "head", "global"),
    "tova": ("uniform", "head", "global"),
    "h2o": ("uniform", "head", "global"),
}


def _held(model: Any, tokenizer: Any, tokens: list[int], method: str, budget: int, mode: str):  # type: ignore[no-untyped-def]
    """(sum of nbytes, MLX active memory the caches free, per-head row counts) of a cut."""
    settings: dict[str, Any] = {f"{method}_budget": budget, f"{method}_allocation": mode}
    if method == "tova":
        settings["tova_scope"] = "head"
    if method == "h2o":  # its default recent window (budget // 2) leaves little to share
        settings["h2o_recent"] = 8
    if method == "expected_attention":  # room in the heads' shares past sinks and the window
        settings["expected_attention_recent"] = 8
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **settings))
    if method == "kvzip":
        prefill(model, caches, tokens)
        compress(model, tokenizer, caches, tokens)
    else:  # the prompt's last token alone, as generation feeds it (TOVA/H2O cut there)
        prefill(model, caches, tokens[:-1])
        prefill(model, caches, tokens[-1:])
        for c in caches:
            c.finish_prefill()
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
    assert uniform_held > 0
    for mode, (held, freed, counts) in results.items():
        assert held <= 1.05 * uniform_held, (mode, held, uniform_held)
        # MLX's active memory: what deleting the caches frees. The tiny model's arrays are a
        # few KiB, where the allocator's rounding shows, hence the slack; a mode that padded
        # its heads, or kept the uncut prompt alive (as the prompt-end step's returned rows
        # did before finish_prefill dropped them: 3.4x here), shows far beyond it.
        assert freed <= 1.05 * max(uniform_freed, uniform_held) + SLACK, (mode, freed)
        if mode != "uniform":  # the heads really keep different counts
            assert len({c for layer in counts for row in layer for c in row}) > 1, mode
