"""Allocation quality: the variants come from the registry, and a CI-sized run through pytest
as `nox -s bench -- allocation_quality` runs it (real caches, the embedded model, real text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def test_variants_are_read_from_the_registry() -> None:
    from velox_bench.quality.allocation import variants

    got = variants()
    assert ("kvzip", "global") in got and ("snapkv", "head") in got
    assert ("snapkv", "global") in got and ("expected_attention", "global") in got
    assert ("tova", "head") in got and ("tova_adapted", "global") in got  # in scope head
    assert ("streaming_llm", "uniform") not in got  # no allocation setting


@pytest.mark.quality
@pytest.mark.model
@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_corpus")
def test_allocation_quality_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_allocation_quality.py")
    out = json.loads((tmp_path / "allocation_quality.json").read_text())
    assert out["settings"]["smoke"] is True
    modes = {(r["method"], r["allocation"]) for r in out["perplexity"]}
    assert {
        ("kvzip", "uniform"),
        ("kvzip", "head"),
        ("kvzip", "global"),
        ("snapkv", "uniform"),
        ("snapkv", "global"),
        ("tova", "uniform"),
        ("tova", "global"),
    } <= modes
    rows = {(r["method"], r["allocation"]) for r in out["retrieval"]["rows"]}
    asked = {("kvzip", "global"), ("snapkv", "global"), ("tova", "global")}
    assert rows == {("full", None)} | asked  # the smoke run asks only the global modes
    assert (tmp_path / "figures" / "allocation_quality.png").stat().st_size > 0
