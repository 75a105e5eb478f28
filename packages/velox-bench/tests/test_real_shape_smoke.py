"""CI-sized run of the real-shape suite (tiny random llama, two contexts) so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from velox_bench.variants import model_methods


@pytest.mark.slow  # a pytest subprocess
def test_real_shape_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_real_shape.py")
    out = json.loads((tmp_path / "real_shape.json").read_text())
    assert out["smoke"] is True
    rows = out["rows"]
    cells = {(r["dtype"], r["context"], r["phase"]) for r in rows}
    expected = {("float32", 96), ("float32", 160), ("bfloat16", 96)}
    assert cells == {(*c, p) for c in expected for p in ("prefill", "decode")}
    for cell in cells:
        assert sorted(
            r["method"] for r in rows if tuple(r[k] for k in ("dtype", "context", "phase")) == cell
        ) == sorted(model_methods())
    ratios = out["summary"]["ratios"]
    assert ratios["float32-decode-160"]["full"]["speedup_vs_full"] == 1.0
    assert ratios["bfloat16-prefill-96"]["rotating"]["time_vs_rotating"] == 1.0
    assert (tmp_path / "figures" / "real_shape.png").stat().st_size > 0
