"""CI-sized run of the distributed benchmark (2 ranks of this host, a tiny llama, a few decode
steps): the runner launches, every variant is timed, the JSON is complete and sane."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from velox_bench.distributed_bench import SMOKE_SETTINGS, VARIANTS, table


@pytest.mark.slow  # a pytest subprocess that launches 2 ranks
def test_distributed_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    if not mx.distributed.is_available():
        pytest.skip("mx.distributed has no backend in this MLX build")
    proc = run_bench_smoke("test_distributed.py", extra=("-s",))
    out = json.loads((tmp_path / "distributed.json").read_text())
    assert out["smoke"] is True
    settings = out["settings"]
    assert settings["ranks"] == 2 and settings["backend"] == "ring"
    assert settings["local_heads"] == {"query": 4, "kv": 2}
    results = out["results"]
    assert list(results) == list(VARIANTS)
    rounds, budget = SMOKE_SETTINGS["rounds"], SMOKE_SETTINGS["budget"]
    for variant, row in results.items():
        assert len(row["step_ms_rounds"]) == rounds
        assert all(t > 0 and math.isfinite(t) for t in row["step_ms_rounds"])
        assert len(row["step_ms_median_per_rank"]) == 2
        # Eviction is active: the Velox caches hold the budget, the full cache everything.
        expected = row["context"] if variant == "full" else budget
        assert row["kept_rows_layer0"] == expected, variant
    assert results["tova_layer"]["ranks_agree"] is True
    assert results["tova_layer_per_layer"]["ranks_agree"] is True
    summary = out["summary"]
    for key in (
        "layer_over_head",
        "layer_over_local",
        "tova_layer_over_full",
        "per_layer_over_head",
    ):
        assert summary[key] > 0 and math.isfinite(summary[key])
    assert summary["layer_overhead_fraction"] < 1 and summary["allreduce_share"] < 1
    assert isinstance(summary["goal_met"], bool)
    assert "layer/head" in proc.stdout and "tova_layer_local" in proc.stdout
    assert "one all_sum per layer" in proc.stdout
    assert "layer/head" in table(out)
