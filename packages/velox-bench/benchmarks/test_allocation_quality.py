"""Allocation modes' quality (`nox -s bench -- allocation_quality`): perplexity after the cut
against budget, retrieval by depth and bytes held, for uniform, head and global allocation of
every policy that offers them (issue 34).

Writes benchmarks/results/allocation_quality.json and the figure (see
``velox_bench.quality.allocation``). ``VELOX_BENCH_SMOKE=1`` runs the CI size and, with
``VELOX_BENCH_RESULTS_DIR``, writes elsewhere.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import math
from typing import Any

import pytest

from velox_bench.results import smoke

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_allocation_quality(benchmark: Any) -> None:
    from velox_bench.quality import allocation as al

    settings = al.AllocationSettings.smoke_run() if smoke() else al.AllocationSettings()
    results = benchmark.pedantic(al.evaluate, args=(settings,), rounds=1, iterations=1)
    print()
    print(al.summary(results))
    for path in al.write(results):
        print(f"wrote {path}")
    rows = results["perplexity"]
    assert all(math.isfinite(r["ppl"]) for r in rows)
    uniform = {
        (r["method"], r["budget"]): r["kv_bytes"] for r in rows if r["allocation"] == "uniform"
    }
    for r in rows[1:]:  # every mode within the uniform cut's bytes
        assert r["kv_bytes"] <= 1.05 * uniform[r["method"], r["budget"]]
