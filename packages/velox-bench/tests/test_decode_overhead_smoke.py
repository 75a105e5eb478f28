"""CI-sized run of the decode-overhead benchmark (tiny model, few steps) so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "test_decode_overhead.py"


@pytest.mark.slow  # a pytest subprocess: ~3-4 s on a 2-core machine
def test_decode_overhead_smoke(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(VELOX_BENCH_SMOKE="1", VELOX_BENCH_RESULTS_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(BENCH), "-q", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "decode_overhead.json").read_text())
    assert out["smoke"] is True
    results = out["results"]
    assert results["soak"]["retained_rows"] == [out["budget"]]
    assert results["at_budget"]["tova_ms"] > 0 and results["after_long_prompt"]["kvcache_ms"] > 0
