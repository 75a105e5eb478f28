"""CI-sized run of the batch benchmark (tiny random llama, three contexts) so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess
def test_batch_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_batch.py")
    out = json.loads((tmp_path / "batch.json").read_text())
    assert out["smoke"] is True
    rows = out["rows"]
    budget, contexts = out["settings"]["budget"], out["settings"]["contexts"]
    assert {(r["context"], r["method"], r["batch"]) for r in rows} == {
        (c, m, b) for c in contexts for m in ("tova", "full") for b in (1, 4)
    }
    assert all(r["tokens_per_s"] > 0 and len(r["rounds"]) == 2 for r in rows)
    tova_kv = {r["context"]: r["kv_bytes"] for r in rows if r["method"] == "tova"}
    full_kv = {r["context"]: r["kv_bytes"] for r in rows if r["method"] == "full"}
    assert tova_kv[contexts[-1]] == tova_kv[contexts[1]]  # bounded: same bytes past the budget
    assert full_kv[contexts[-1]] > full_kv[contexts[1]]
    summary = out["summary"]["tiny"]
    assert set(summary["contexts"]) == {str(c) for c in contexts}
    assert f"eviction_overhead_b4_{budget}" in summary["targets"]
    assert summary["peak_growth_b4"]["tova"]["kv_ratio"] == 1.0
    assert (tmp_path / "figures" / "batch.png").stat().st_size > 0
