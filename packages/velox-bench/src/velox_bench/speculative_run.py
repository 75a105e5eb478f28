"""One speculative generation with Velox (or full) caches, and the "vs full" summary of several.

Shared by ``benchmarks/test_speculative.py`` (its vs-full part) and
``velox_bench.probes.speculative_compare`` (the same measurement for chosen methods).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import speculative_generate_step

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

__all__ = ["spec_run", "vs_full"]


def spec_run(
    model: Any,
    draft: Any,
    config: KVCacheConfig,
    prompt: mx.array,
    max_tokens: int,
    num_draft: int,
) -> dict[str, Any]:
    """One speculative generation: the seconds from the first token to the last (the prompt's
    prefill and the first round are not timed, as mlx-lm's generation tokens/s), tokens, and
    how many of the timed ones came from the draft."""
    caches = KVCacheBuilder.for_model(model, config) + KVCacheBuilder.for_model(draft, config)
    tokens: list[int] = []
    accepted, first = 0, 0.0
    for token, _, from_draft in speculative_generate_step(
        prompt,
        model,
        draft,
        prompt_cache=caches,
        max_tokens=max_tokens,
        num_draft_tokens=num_draft,
    ):
        if not tokens:
            first = time.perf_counter()
        else:
            accepted += bool(from_draft)
        tokens.append(int(token))
    return {"seconds": time.perf_counter() - first, "tokens": tokens, "accepted": accepted}


def vs_full(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per method (``"full"`` among them): median tokens/s and its ratio to the full cache's,
    the median time per verify round and its ratio, and the acceptance rate. Each verify round
    yields its accepted draft tokens and one from the target, so the time per round does not
    depend on how often a cache's tokens match the draft's."""
    rate = {
        m: statistics.median((len(r["tokens"]) - 1) / r["seconds"] for r in rs)
        for m, rs in runs.items()
    }
    per_round = {
        m: statistics.median(r["seconds"] / (len(r["tokens"]) - 1 - r["accepted"]) for r in rs)
        for m, rs in runs.items()
    }
    return {
        m: {
            "speculative_tokens_per_s": rate[m],
            "vs_full": rate[m] / rate["full"],
            "round_ms": per_round[m] * 1e3,
            "round_vs_full": per_round[m] / per_round["full"],
            "acceptance_rate": rs[0]["accepted"] / (len(rs[0]["tokens"]) - 1),
            "tokens": len(rs[0]["tokens"]),
            "rounds": len(rs),
        }
        for m, rs in runs.items()
    }
