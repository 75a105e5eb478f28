"""Quality per byte: the equal-bytes budgets, and a CI-sized run through pytest as
`nox -s bench -- quality_per_byte` runs it (real caches on one short text)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def test_equal_bytes_budgets() -> None:
    from velox_bench.quality.per_byte import equal_bytes_budget, row_bytes

    # the float32 embedded model (head_dim 64), group 64: 9, 5 and 3 bits per element
    assert [equal_bytes_budget(512, 64, 4, b) for b in (None, 8, 4, 2)] == [512, 1820, 3276, 5461]
    # float16, group 64: 8.5, 4.5 and 2.5 bits against 16
    assert [equal_bytes_budget(512, 128, 2, b) for b in (8, 4, 2)] == [963, 1820, 3276]
    assert row_bytes(64, 4, 4) / row_bytes(64, 4, None) == pytest.approx(5 / 32)
    # keys per channel: a 4-byte row map entry per row, and room for 63 dead quantized key rows
    # and 63 full-precision window rows: (512 * 512 - 63 * (40 + 256)) // (80 + 4) = 2898
    assert [equal_bytes_budget(512, 64, 4, b, "channel") for b in (4, 2)] == [2898, 4702]
    assert equal_bytes_budget(8, 64, 4, 4, "channel") == 0  # the overheads do not fit


def test_a_partial_run_keeps_the_rows_it_did_not_measure() -> None:
    from velox_bench.quality.per_byte import merged

    def row(method: str, bits: int | None, ppl: float) -> dict[str, Any]:
        return {"method": method, "bits": bits, "layout": "token", "same_budget": False, "ppl": ppl}

    settings = {"tokens": 64, "budget": 8, "retrieval_budget": 8, "retrieval_tokens": 50}
    settings |= {"trials": 1, "chunk": 16}
    before = {"settings": settings, "perplexity": [row("full", None, 1.0), row("tova", None, 2.0)]}
    before["retrieval"] = {"rows": [row("kvzip", 4, 0.5)]}
    now = {"settings": settings, "perplexity": [row("tova", 8, 3.0), row("full", None, 1.5)]}
    now["retrieval"] = None
    out = merged(before, now)
    got = [(r["method"], r["bits"], r["ppl"]) for r in out["perplexity"]]
    assert got == [("full", None, 1.5), ("tova", None, 2.0), ("tova", 8, 3.0)]
    assert out["retrieval"] == before["retrieval"]
    assert out["kept_from_earlier_run"] == ["perplexity tova fp", "retrieval"]
    # another text or budget: nothing is kept
    other = merged(before, {**now, "settings": {**settings, "budget": 16}})
    assert other["retrieval"] is None and len(other["perplexity"]) == 2


@pytest.mark.quality
@pytest.mark.model
@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_corpus")
def test_quality_per_byte_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_quality_per_byte.py")
    out = json.loads((tmp_path / "quality_per_byte.json").read_text())
    assert out["settings"]["smoke"] is True
    rows = {(r["method"], r["bits"]): r for r in out["perplexity"] if not r["same_budget"]}
    assert {("full", None), ("mlx-quantized", 8), ("mlx-quantized", 4)} <= set(rows)
    budgets = {
        (r["bits"], r["same_budget"]): r["budget"]
        for r in out["perplexity"]
        if r["method"] == "tova"
    }
    assert [budgets[b, False] for b in (None, 8, 4, 2)] == [8, 28, 51, 85]
    assert budgets[8, True] == budgets[4, True] == 8
    assert rows["tova", 4]["kv_bytes"] <= rows["tova", None]["kv_bytes"] * 1.01
    assert {r["bits"] for r in out["retrieval"]["rows"]} == {None, 8, 4, 2}
    assert (tmp_path / "figures" / "quality_per_byte.png").stat().st_size > 0
