"""CI-sized run of the decode-overhead benchmark (tiny model, few steps) so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess: ~3-4 s on a 2-core machine
def test_decode_overhead_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_decode_overhead.py")
    out = json.loads((tmp_path / "decode_overhead.json").read_text())
    assert out["smoke"] is True
    results = out["results"]
    assert results["soak"]["retained_rows"] == [out["budget"]]
    assert results["at_budget"]["tova_ms"] > 0 and results["after_long_prompt"]["kvcache_ms"] > 0
