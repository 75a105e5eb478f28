"""Every performance suite's code path with tiny sizes and one round, in a subprocess.

``VELOX_BENCH_SMOKE=1`` shrinks the suites (tiny random llama instead of the embedded model);
``VELOX_BENCH_RESULTS_DIR`` sends results and figures to a temporary directory, so the committed
``benchmarks/results`` are never touched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO_RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
SUITES = ["micro", "prefill", "model", "soak"]


def _snapshot() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in REPO_RESULTS.glob("*.json")}


@pytest.mark.slow
def test_every_suite_runs_tiny(tmp_path: Path, run_bench_smoke: Any) -> None:
    before = _snapshot()
    run_bench_smoke(*(f"test_{suite}.py" for suite in SUITES), extra=("-x",))
    for suite in SUITES:
        data = json.loads((tmp_path / f"{suite}.json").read_text())
        assert data["smoke"] is True
        assert data["rows"], suite
        assert data["machine"]["cpu_count"]
        assert data["blas"]["blas_in_use"]
    summary = json.loads((tmp_path / "micro.json").read_text())["summary"]
    assert all(r["sdpa"] == 1.0 for r in summary["ratio_vs_sdpa"].values())
    for name in ("decode_latency", "decode_tokens_per_s", "kv_memory", "prefill_loglog"):
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 0
    assert _snapshot() == before, "the smoke run touched the committed results"
