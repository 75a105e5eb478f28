"""CI-sized run of the serving load benchmark (2 conversations, 2 short turns, two servers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.mark.slow  # a pytest subprocess that starts two servers
@pytest.mark.model
def test_serve_load_smoke(tmp_path: Path, run_bench_smoke: Any, embedded_model: None) -> None:
    run_bench_smoke("test_serve_load.py")
    out = json.loads((tmp_path / "serve.json").read_text())
    assert out["smoke"] is True
    methods = out["summary"]["methods"]
    assert set(methods) == {"tova(64)", "full"}
    for summary in methods.values():
        assert [t["turn"] for t in summary["per_turn"]] == [0, 1]
        assert summary["peak_rss_bytes"] > 0
    assert methods["tova(64)"]["max_tokens_kept"] <= 64
    assert len(out["rows"]) == 2 * 2 * 2
    assert all(r["chunks"] > 0 and r["ttft_s"] > 0 for r in out["rows"])
    assert "decode_ratio_longest_turn" in out["summary"]["goals"]
    assert (tmp_path / "figures" / "serve.png").stat().st_size > 0
