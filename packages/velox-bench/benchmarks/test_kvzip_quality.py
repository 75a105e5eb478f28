"""KVzip, many questions about one document compressed once (`nox -s bench -- kvzip_quality`).

Writes benchmarks/results/kvzip_quality.json and benchmarks/figures/kvzip_quality.png (see
``velox_bench.quality.kvzip_quality``). ``VELOX_BENCH_SMOKE=1`` runs the CI size (a tiny
document, two questions) and, with ``VELOX_BENCH_RESULTS_DIR``, writes elsewhere.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
from typing import Any

import pytest

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_kvzip_quality(benchmark: Any) -> None:
    from velox_bench.quality import kvzip_quality as kq

    settings = kq.settings_from_env()
    results = benchmark.pedantic(kq.evaluate, args=(settings,), rounds=1, iterations=1)
    print()
    print(kq.summary(results))
    for path in kq.write(results):
        print(f"wrote {path}")
    kvzip = results["kvzip"]
    # budget rows per head on average (whole rows per layer: within one of it)
    assert abs(kvzip["kept_rows"] - settings.budget) <= 1 and kvzip["chunks"] >= 1
    assert set(results["results"]["full"]) == {f"{d:.1f}" for d in settings.depths}
