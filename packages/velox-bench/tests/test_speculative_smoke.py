"""CI-sized run of the speculative benchmark (tiny random llama, few steps) so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess
def test_speculative_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_speculative.py")
    out = json.loads((tmp_path / "speculative.json").read_text())
    assert out["smoke"] is True
    undo, spec = out["results"]["undo_log_cost"], out["results"]["speculative"]
    assert set(undo) == set(spec) == {"tova", "tova_adapted", "h2o", "streaming_llm", "morphkv"}
    assert all(r["ratio"] > 0 and r["undo_bytes"] > 0 for r in undo.values())
    assert all(r["identical_tokens"] and r["kept_rows"] <= 16 for r in spec.values())
    vs_full = out["results"]["speculative_vs_full"]["draft_1"]
    assert set(vs_full) == {"full", *spec}
    assert vs_full["full"]["vs_full"] == 1.0
    assert all(r["speculative_tokens_per_s"] > 0 and r["tokens"] == 8 for r in vs_full.values())
