"""Where KVzip's cut keeps rows, by depth (`nox -s bench -- kvzip_depth`).

Writes benchmarks/results/kvzip_depth.json and benchmarks/figures/kvzip_depth.png (see
``velox_bench.quality.kvzip_depth``). ``VELOX_BENCH_SMOKE=1`` runs the CI size (one short
document) and, with ``VELOX_BENCH_RESULTS_DIR``, writes elsewhere.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
from typing import Any

import pytest

from velox_bench.results import smoke

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_kvzip_depth(benchmark: Any) -> None:
    from velox_bench.quality import kvzip_depth as kd

    settings = kd.DepthSettings.smoke_run() if smoke() else kd.DepthSettings()
    results = benchmark.pedantic(kd.evaluate, args=(settings,), rounds=1, iterations=1)
    print()
    print(kd.summary(results))
    for path in kd.write(results):
        print(f"wrote {path}")
    for allocation, mean in results["kept_mean"].items():  # budget rows per head on average
        assert mean == pytest.approx(results["even"], abs=1e-6), allocation
