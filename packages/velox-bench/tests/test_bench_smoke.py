"""Every performance suite's code path with tiny sizes and one round, in a subprocess.

``VELOX_BENCH_SMOKE=1`` shrinks the suites (tiny random llama instead of the embedded model);
``VELOX_BENCH_RESULTS_DIR`` sends results and figures to a temporary directory, so the committed
``benchmarks/results`` are never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
REPO_RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
SUITES = ["micro", "prefill", "model", "soak"]


def _snapshot() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in REPO_RESULTS.glob("*.json")}


@pytest.mark.slow
def test_every_suite_runs_tiny(tmp_path: Path) -> None:
    before = _snapshot()
    # Without the pytest-xdist worker variables (under `-n`): pytest-benchmark reads
    # PYTEST_XDIST_WORKER and would disable itself in the child, which then measures nothing.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(VELOX_BENCH_SMOKE="1", VELOX_BENCH_RESULTS_DIR=str(tmp_path))
    files = [str(BENCH_DIR / f"test_{suite}.py") for suite in SUITES]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-x"],
        cwd=BENCH_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
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
