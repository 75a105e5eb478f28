"""CI-sized runs of the serving soak and fault benchmarks (issue 33, point 5): a server whose
context is lowered to 160 tokens, two short conversations past it, then the full cache within
it; clients killed mid-stream; SIGTERM with streams in flight, then a restart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess that starts two servers
@pytest.mark.model
def test_serve_soak_smoke(tmp_path: Path, run_bench_smoke: Any, embedded_model: None) -> None:
    run_bench_smoke("test_serve_soak.py")
    out = json.loads((tmp_path / "serve_soak.json").read_text())
    assert out["smoke"] is True
    methods = out["summary"]["methods"]
    assert set(methods) == {"tova(32)", "full"}
    bounded, full = methods["tova(32)"], methods["full"]
    for summary in methods.values():
        assert summary["lost"] == 0 and summary["refused"] == 0
        assert summary["completed"] == summary["requests"] > 0
        assert summary["itl_p50_s"] is not None and summary["itl_p99_s"] is not None
    assert min(bounded["max_prompt_tokens_per_conversation"]) > 400
    assert max(full["max_prompt_tokens_per_conversation"]) <= 160
    assert bounded["max_tokens_kept"] <= 32
    assert bounded["rss"]["samples"] > 0 and bounded["rss"]["growth"] is not None
    assert {r["outcome"] for r in out["rows"]} == {"completed"}


@pytest.mark.slow  # a pytest subprocess that starts five servers
@pytest.mark.model
def test_serve_faults_smoke(tmp_path: Path, run_bench_smoke: Any, embedded_model: None) -> None:
    run_bench_smoke("test_serve_faults.py")
    out = json.loads((tmp_path / "serve_faults.json").read_text())
    faults = [r["fault"] for r in out["rows"]]
    assert faults == ["clients_killed", "sigterm", "sigterm"]
    for row in out["rows"][1:]:
        assert row["exit_code"] == 0
        assert set(row["outcomes"]) == {"completed"}
        assert row["restart_first_request"] == "completed"
