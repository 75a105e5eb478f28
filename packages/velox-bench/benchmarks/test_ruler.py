"""RULER-style tasks beyond one needle (`nox -s bench -- ruler`): several keys, several values,
variable tracking and common-word counting, for each embedded model, method and budget.

The full grid takes hours on 2 CPUs, so it runs only with ``VELOX_RULER=full`` (and then writes
benchmarks/results/ruler.json): both embedded models, 2k, 4k and 8k tokens, 5 samples, the full
cache and TOVA, H2O, StreamingLLM and SnapKV at budgets 256 and 1024. Without it, a quick run
(SmolLM2, 2k tokens, one sample, the full cache and TOVA(256)) prints its rows and writes
nothing. Each part of the grid can be set on its own:

- ``VELOX_RULER_MODELS``: embedded model names, comma-separated;
- ``VELOX_RULER_LENGTHS``: context lengths;
- ``VELOX_RULER_SAMPLES``: seeded samples per task and length;
- ``VELOX_RULER_BUDGETS``: budgets of every method;
- ``VELOX_RULER_METHODS``: methods beside the full cache;
- ``VELOX_BENCH_SMOKE=1``: one 256-token sample of each task on SmolLM2, TOVA(64), 4 tokens.
``VELOX_BENCH_RESULTS_DIR`` writes ruler.json there, whatever the size.

Rows are appended to ``ruler.partial.jsonl`` beside ruler.json as they come; a rerun skips
the rows already there, so the grid can be stopped and resumed, or grown (more samples).
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import json
import os
from pathlib import Path
from typing import Any

import pytest

from velox_bench.quality import methods, ruler_report
from velox_bench.quality.ruler_run import Grid, evaluate, row_key

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]

SMOKE = os.environ.get("VELOX_BENCH_SMOKE") == "1"


FULL_GRID = {
    "MODELS": "smollm2-135m,gemma3-270m",
    "LENGTHS": "2048,4096,8192",
    "SAMPLES": "5",
    "BUDGETS": "256,1024",
    "METHODS": "tova,h2o,streaming_llm,snapkv",
}
QUICK_GRID = {
    "MODELS": "smollm2-135m",
    "LENGTHS": "2048",
    "SAMPLES": "1",
    "BUDGETS": "256",
    "METHODS": "tova",
}
FULL = os.environ.get("VELOX_RULER") == "full"


def _setting(name: str) -> list[str]:
    default = (FULL_GRID if FULL else QUICK_GRID)[name]
    return [x for x in os.environ.get(f"VELOX_RULER_{name}", default).split(",") if x]


def _grid() -> tuple[list[str], Grid]:
    if SMOKE:
        smoke = Grid(lengths=(256,), samples=1, runs=[(methods.TOVA, 64)], max_tokens=4)
        return ["smollm2-135m"], smoke
    found = {v.method: v for v in methods.retrieval_variants()} | {"tova": methods.TOVA}
    budgets = [int(b) for b in _setting("BUDGETS")]
    runs = [(methods.FULL, 0)] + [(found[m], b) for m in _setting("METHODS") for b in budgets]
    lengths = [int(n) for n in _setting("LENGTHS")]
    grid = Grid(lengths=lengths, samples=int(_setting("SAMPLES")[0]), runs=runs)
    return _setting("MODELS"), grid


def _out_dir() -> Path | None:
    where = os.environ.get("VELOX_BENCH_RESULTS_DIR")
    if where is None and not FULL:
        return None
    return Path(where) if where else Path(__file__).parents[3] / "benchmarks" / "results"


def _rows_so_far(partial: Path) -> list[dict[str, Any]]:
    """Rows an earlier run (cut short, or with a smaller grid) appended to ``partial``."""
    if not partial.exists():
        return []
    lines = partial.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_ruler(benchmark: Any) -> None:
    """Rows are appended to ruler.partial.jsonl as they come, and a rerun skips the rows
    already there, so the long grid can be stopped and resumed (or grown: more samples).
    ruler.json holds every row of the file at the end."""
    from velox_mlx_lm.embedded import load

    names, grid = _grid()
    out = _out_dir()
    partial = out / "ruler.partial.jsonl" if out else None
    earlier = _rows_so_far(partial) if partial else []
    if partial:
        partial.parent.mkdir(parents=True, exist_ok=True)

    def keep(row: dict[str, Any]) -> None:
        if partial:
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def run() -> list[dict[str, Any]]:
        models = [(name, *load(name)) for name in names]
        return evaluate(models, grid, {row_key(r) for r in earlier}, keep)

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    assert all(0 <= r["score"] <= 1 for r in rows)
    for r in rows:
        run_name = f"{r['method']}({r['budget']})" if r["budget"] else r["method"]
        print(f"{r['model']} {r['task']} {r['length']} #{r['seed']} {run_name}: {r['score']:.2f}")
    if out is None or partial is None:
        assert rows
        return
    every = _rows_so_far(partial)
    (out / "ruler.json").write_text(json.dumps({"grid": str(grid), "rows": every}, indent=1))
    if "VELOX_BENCH_RESULTS_DIR" not in os.environ:  # the repository's own results: the docs too
        ruler_report.write(every, Path(__file__).parents[3])
