"""CI-sized run of the quantized decode-step comparison (tiny layer, two rounds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess: a few seconds
def test_quantized_decode_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_quantized_decode.py")
    out = json.loads((tmp_path / "quantized_decode.json").read_text())
    assert out["smoke"] is True
    assert [r["case"]["context"] for r in out["rows"]] == [8, 48, 80]
    assert out["rows"][-1]["case"]["layout"] == "channel"
    assert all(r["ratio"] > 0 for r in out["rows"])
