"""RULER-style tasks beyond one needle (`nox -s bench -- ruler`): several keys, several values,
variable tracking and common-word counting at 2k, 4k and 8k tokens, for each embedded model,
method and budget. Writes benchmarks/results/ruler.json.

The grid comes from the environment (the full run takes hours on 2 CPUs):

- ``VELOX_RULER_MODELS``: embedded model names, comma-separated (default: both);
- ``VELOX_RULER_LENGTHS``: context lengths (default ``2048,4096,8192``);
- ``VELOX_RULER_SAMPLES``: seeded samples per task and length (default 5);
- ``VELOX_RULER_BUDGETS``: budgets of every method (default ``256,1024``);
- ``VELOX_RULER_METHODS``: methods beside the full cache (default
  ``tova,h2o,streaming_llm,snapkv``);
- ``VELOX_BENCH_SMOKE=1``: one 256-token sample of each task on SmolLM2, TOVA(64), 4 tokens.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import json
import os
from pathlib import Path
from typing import Any

import pytest

from velox_bench.quality import methods
from velox_bench.quality.ruler_run import Grid, evaluate

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]

SMOKE = os.environ.get("VELOX_BENCH_SMOKE") == "1"


def _ints(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).split(",") if x]


def _grid() -> tuple[list[str], Grid]:
    if SMOKE:
        smoke = Grid(lengths=(256,), samples=1, runs=[(methods.TOVA, 64)], max_tokens=4)
        return ["smollm2-135m"], smoke
    models = os.environ.get("VELOX_RULER_MODELS", "smollm2-135m,gemma3-270m").split(",")
    budgets = _ints("VELOX_RULER_BUDGETS", "256,1024")
    wanted = os.environ.get("VELOX_RULER_METHODS", "tova,h2o,streaming_llm,snapkv").split(",")
    found = {v.method: v for v in methods.retrieval_variants()} | {"tova": methods.TOVA}
    chosen = [found[m] for m in wanted]
    runs = [(methods.FULL, 0)] + [(v, b) for v in chosen for b in budgets]
    grid = Grid(
        lengths=_ints("VELOX_RULER_LENGTHS", "2048,4096,8192"),
        samples=_ints("VELOX_RULER_SAMPLES", "5")[0],
        runs=runs,
    )
    return models, grid


def test_ruler(benchmark: Any) -> None:
    from velox_mlx_lm.embedded import load

    models, grid = _grid()

    def run() -> list[dict[str, Any]]:
        rows = []
        for name in models:
            model, tokenizer = load(name)
            rows += evaluate(model, tokenizer, name, grid)
        return rows

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    assert rows and all(0 <= r["score"] <= 1 for r in rows)
    out = Path(
        os.environ.get("VELOX_BENCH_RESULTS_DIR", Path(__file__).parents[3] / "benchmarks/results")
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "ruler.json").write_text(json.dumps({"grid": str(grid), "rows": rows}, indent=1))
