"""Quality per byte (`nox -s bench -- quality_per_byte`): perplexity and retrieval of
quantized and full-precision Velox caches holding the same KV bytes (issue 30).

Writes benchmarks/results/quality_per_byte.json and the figure (see
``velox_bench.quality.per_byte``). ``VELOX_BENCH_SMOKE=1`` runs the CI size and, with
``VELOX_BENCH_RESULTS_DIR``, writes elsewhere. ``VELOX_PER_BYTE_TOKENS`` and
``VELOX_PER_BYTE_BUDGET`` shrink the perplexity run (default 8192 tokens, budget 512).
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import math
import os
from dataclasses import replace
from typing import Any

import pytest

from velox_bench.results import smoke

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_quality_per_byte(benchmark: Any) -> None:
    from velox_bench.quality import per_byte as pb

    settings = pb.PerByteSettings.smoke_run() if smoke() else pb.PerByteSettings()
    for name, field in (("TOKENS", "tokens"), ("BUDGET", "budget")):
        value = os.environ.get(f"VELOX_PER_BYTE_{name}")
        if value:
            settings = replace(settings, **{field: int(value)})
    results = benchmark.pedantic(pb.evaluate, args=(settings,), rounds=1, iterations=1)
    print()
    print(pb.summary(results))
    for path in pb.write(results):
        print(f"wrote {path}")
    rows = results["perplexity"]
    assert all(math.isfinite(r["ppl"]) for r in rows)
    fp = next(r for r in rows if r["method"] == "tova" and r["bits"] is None)
    for r in rows:  # equal bytes: every quantized Velox row holds at most its fp row's bytes
        # (the same-budget rows are not equal bytes: per-channel keys' window and dead rows
        # outweigh a tiny smoke budget's rows)
        if r["method"] == "tova" and r["bits"] is not None and not r["same_budget"]:
            assert r["kv_bytes"] <= fp["kv_bytes"] * 1.01
