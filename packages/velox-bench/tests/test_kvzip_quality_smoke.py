"""CI-sized run of the KVzip quality benchmark (embedded model, a ~150-token document, two
questions) through pytest, as `nox -s bench -- kvzip_quality` runs it: the real prefill,
reconstruction pass, prompt-cache save/load and questions, end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.quality, pytest.mark.model, pytest.mark.corpus, pytest.mark.slow]


@pytest.mark.usefixtures("embedded_corpus")
def test_kvzip_quality_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_kvzip_quality.py")
    out = json.loads((tmp_path / "kvzip_quality.json").read_text())
    assert out["smoke"] is True
    assert out["document"]["questions"] == 2
    settings = out["settings"]
    assert out["kvzip"]["context_tokens"] == out["document"]["tokens"] > settings["budget"]
    assert out["kvzip"]["chunks"] == 2  # the document is longer than one reconstruction chunk
    assert out["kvzip"]["scored_tokens"] > out["document"]["tokens"]
    # budget rows per head on average, exactly with every allocation at this budget (whole
    # lanes); the adaptive ones hold no more bytes than the uniform cut
    assert out["kvzip"]["kept_rows"] == settings["budget"]
    for name in ("kvzip (head)", "kvzip (uniform)"):
        assert out["kept"][name]["kept_rows"] == settings["budget"]
    uniform = out["kept"]["kvzip (uniform)"]["kv_bytes"]
    assert out["kept"]["kvzip"]["kv_bytes"] <= uniform
    assert out["kept"]["kvzip (head)"]["kv_bytes"] <= uniform
    assert out["kvzip_latest"]["scored_tokens"] == 0  # the latest probe runs no pass
    rows = out["results"]
    assert set(rows) == {
        "kvzip",
        "kvzip (latest)",
        "kvzip (head)",
        "kvzip (uniform)",
        "full",
        "tova (query/layer)",
    }
    for by_depth in rows.values():
        assert set(by_depth) == {"0.1", "0.9"}
        assert all(len(r["correct"]) == 1 for r in by_depth.values())
    assert all(r["logprob_vs_full"] == 0 for r in rows["full"].values())
    assert set(out["goal"]["per_depth"]) == {"0.1", "0.9"}
    assert [set(r) for r in out["cost"]["rounds"]] == [
        {"full_prefill_s", "kvzip_prefill_s", "kvzip_scoring_s"}
    ]
    assert (tmp_path / "figures" / "kvzip_quality.png").stat().st_size > 0
