"""Perplexity per window past the model's context (`nox -s bench -- past_context`).

The full runs take about an hour each on 2 CPUs, so they run only with
``VELOX_PAST_CONTEXT=full``: 16,384 tokens on SmolLM2-135M (twice its context) and 40,960 on
Gemma 3 270M (context 32,768), every method ``velox-serve --beyond-context`` serves at budget
512 and the full cache, in 2,048-token windows. They write
benchmarks/results/past_context_<model>.json, a figure and their section of docs/benchmarks.md.
``VELOX_PAST_CONTEXT_MODELS`` (comma-separated) picks the models. Without ``full``, a quick run
(SmolLM2, 1,024 tokens in windows of 256, TOVA(128) and the full cache) prints its table and
writes nothing.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import math
import os
from typing import Any

import pytest

from velox_bench.quality.past_context import PastContextSettings, evaluate, summary, write
from velox_bench.quality.run import repo_root

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]

FULL = os.environ.get("VELOX_PAST_CONTEXT") == "full"
MODELS = os.environ.get("VELOX_PAST_CONTEXT_MODELS", "smollm2-135m,gemma3-270m").split(",")


@pytest.mark.parametrize("model", MODELS if FULL else ["smollm2-135m"])
def test_past_context(benchmark: Any, model: str) -> None:
    settings = (
        PastContextSettings.for_model(model)
        if FULL
        else PastContextSettings(
            model=model, tokens=1024, window=256, budget=128, methods=("tova",)
        )
    )
    results = benchmark.pedantic(evaluate, args=(settings,), rounds=1, iterations=1)
    print(summary(results))
    assert all(math.isfinite(p) for row in results["rows"].values() for p in row["windows"])
    if FULL:
        for path in write(results, repo_root()):
            print(f"wrote {path}")
