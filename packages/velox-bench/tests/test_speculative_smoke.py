"""CI-sized run of the speculative benchmark (tiny random llama, few steps) so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "test_speculative.py"


@pytest.mark.slow  # a pytest subprocess
def test_speculative_smoke(tmp_path: Path) -> None:
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
    out = json.loads((tmp_path / "speculative.json").read_text())
    assert out["smoke"] is True
    undo, spec = out["results"]["undo_log_cost"], out["results"]["speculative"]
    assert set(undo) == set(spec) == {"tova", "tova_adapted", "h2o", "streaming_llm", "morphkv"}
    assert all(r["ratio"] > 0 and r["undo_bytes"] > 0 for r in undo.values())
    assert all(r["identical_tokens"] and r["kept_rows"] <= 16 for r in spec.values())
