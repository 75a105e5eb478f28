"""The full quality evaluation (`nox -s bench -- quality`): perplexity and retrieval.

Writes benchmarks/results/quality.json, the figures and the quality sections of the docs.
``VELOX_QUALITY_QUICK=1`` runs the small ``--quick`` settings and writes nothing.
``VELOX_QUALITY_MODEL=gemma3-270m`` runs on that embedded model instead (its results, figures
and docs section carry its name: ``quality_gemma3-270m.json``).
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import math
import os
from dataclasses import replace
from typing import Any

import pytest

from velox_bench.quality import report
from velox_bench.quality.run import evaluate, repo_root
from velox_bench.quality.settings import Settings

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_quality(benchmark: Any) -> None:
    quick = os.environ.get("VELOX_QUALITY_QUICK") == "1"
    settings = Settings.quick_run() if quick else Settings()
    settings = replace(settings, model=os.environ.get("VELOX_QUALITY_MODEL", settings.model))
    results = benchmark.pedantic(evaluate, args=(settings,), rounds=1, iterations=1)
    print(report.summary(results))
    ppl = results["perplexity"]["ppl"]
    assert math.isfinite(ppl["full"]["full"]) and 1 < ppl["full"]["full"] < 100
    assert all(math.isfinite(v) for row in ppl.values() for v in row.values())
    if not quick:
        for path in report.write(results, repo_root()):
            print(f"wrote {path}")
