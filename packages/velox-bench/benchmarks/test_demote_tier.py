"""The demoted tier at equal KV bytes (`nox -s bench -- demote_tier`, issue 49 point 4): pure
eviction at full precision and 8 bits against half the rows plus a 2- or 4-bit tier, for TOVA,
H2O and SnapKV on the embedded model: retrieval by depth, streaming perplexity, one layer's
decode step.

Writes benchmarks/results/demote_tier.json (see ``velox_bench.quality.demote_tier``).
``VELOX_BENCH_SMOKE=1`` runs the CI size and writes nothing.
"""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
import json
import math
from typing import Any

import pytest

from velox_bench.results import results_dir, smoke

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.model, pytest.mark.corpus]


def test_demote_tier(benchmark: Any) -> None:
    from velox_bench.quality import demote_tier as dt

    settings = dt.TierSettings.smoke_run() if smoke() else dt.TierSettings()
    results = benchmark.pedantic(dt.evaluate, args=(settings,), rounds=1, iterations=1)
    print()
    print(dt.summary(results))
    for r in results["perplexity"]["rows"]:
        assert math.isfinite(r["ppl"])
    if not smoke():
        path = results_dir() / f"{dt.RESULTS}.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path}")
