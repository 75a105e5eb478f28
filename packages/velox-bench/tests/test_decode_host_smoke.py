"""CI-sized run of the decode host/eval time suite (``velox_bench.decode_host``): a tiny random
llama, a 48-token prompt, budget 16, 3 steps, one round, in this process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO_RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def _snapshot() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in REPO_RESULTS.glob("*.json")}


def _check_rows(run: dict[str, Any], expected: list[str]) -> None:
    rows = {r["method"]: r for r in run["rows"]}
    assert list(rows) == expected
    full, rotating = rows["full"], rows["rotating"]
    for r in rows.values():
        assert r["host_ms"] > 0 and r["eval_ms"] > 0 and r["timed_steps"] == 3
        assert r["flush_ms_per_step"] > 0
        assert r["host_vs_full"] == pytest.approx(r["host_ms"] / full["host_ms"])
        assert r["eval_vs_full"] == pytest.approx(r["eval_ms"] / full["eval_ms"])
        assert r["total_vs_full"] == pytest.approx(r["total_ms"] / full["total_ms"])
        assert r["total_vs_rotating"] == pytest.approx(r["total_ms"] / rotating["total_ms"])
        fast = r["fast_path_fraction"]
        if r["baseline"]:
            assert fast is None
        else:
            assert fast is not None and 0 <= fast <= 1
        if r["method"] in FAST:  # steady decode at the budget: every layer on the fast path
            assert fast == 1.0, r["method"]
        if r["method"] == "expected_attention":  # not opted in: the general path
            assert fast == 0.0
    assert full["host_vs_full"] == full["eval_vs_full"] == 1.0


FAST = ("tova", "tova_adapted", "h2o", "streaming_llm", "snapkv", "morphkv")


def test_decode_host_measure_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_BENCH_SMOKE", "1")
    from velox_bench.decode_host import (
        SMOKE_SETTINGS,
        load_model,
        measure,
        methods,
        skipped_methods,
        table,
    )

    run = measure(load_model("real-shape", small=True), SMOKE_SETTINGS)
    expected = methods()
    assert expected[:2] == ["full", "rotating"] and len(expected) > 2
    _check_rows(run, expected)
    assert run["skipped"] == skipped_methods()
    assert not set(run["skipped"]) & set(expected)
    assert all(m in table(run) for m in expected)


def test_decode_host_main_writes_only_where_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VELOX_BENCH_SMOKE", "1")
    monkeypatch.setenv("VELOX_BENCH_RESULTS_DIR", str(tmp_path))
    from velox_bench.decode_host import main

    before = _snapshot()
    out = main(["--model", "real-shape", "--methods", "full,rotating,tova", "--no-progress"])
    saved = json.loads((tmp_path / "decode_host.json").read_text())
    assert saved["smoke"] is True and saved["suite"] == "decode_host"
    assert saved["blas"]["blas_in_use"] and saved["machine"]["cpu_count"]
    assert saved["runs"][0]["settings"]["context"] == 48
    assert [r["method"] for r in saved["runs"][0]["rows"]] == ["full", "rotating", "tova"]
    assert out["runs"][0]["rows"] == saved["runs"][0]["rows"]
    _check_rows(saved["runs"][0], ["full", "rotating", "tova"])
    assert "tova" in capsys.readouterr().out
    assert _snapshot() == before, "the smoke run touched the committed results"
