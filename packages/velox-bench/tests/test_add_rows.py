"""Adding one method's rows to committed suite results (``VELOX_BENCH_ADD_ROWS``)."""

from __future__ import annotations

from typing import Any

import pytest

from velox_bench.results import SuiteResults, add_rows


def _row(method: str, seconds: float, context: int = 1024) -> dict[str, Any]:
    return {"phase": "decode", "context": context, "method": method, "seconds": seconds}


def _saved() -> dict[str, Any]:
    return {
        "suite": "model",
        "smoke": False,
        "settings": {"contexts": [1024], "decode_steps": 32},
        "summary": {},
        "rows": [_row("full", 2.0), _row("old", 1.0), _row("tova", 1.5)],
    }


def _fresh(settings: dict[str, Any] | None = None) -> SuiteResults:
    fresh = SuiteResults("model", settings=settings or {"contexts": [1024], "decode_steps": 32})
    fresh.add(**_row("full", 3.0))
    fresh.add(**_row("new", 0.5))
    fresh.add(**_row("old", 0.7))
    return fresh


def test_rows_are_added_in_order_and_baselines_only_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VELOX_BENCH_SMOKE", raising=False)
    out = add_rows(_saved(), _fresh(), ["new", "old"], {"blas": "x"}, ["full", "new", "tova"])
    assert [(r["method"], r["seconds"]) for r in out["rows"]] == [
        ("full", 2.0),  # the saved baseline stays; the fresh one is only compared
        ("new", 0.5),
        ("tova", 1.5),
        ("old", 0.7),  # replaced; not in the order given: last
    ]
    (added,) = out["added_rows"]
    assert added["methods"] == ["new", "old"] and added["blas"] == {"blas": "x"}
    assert added["baseline_seconds_now_over_saved"] == {"decode 1024 full": 1.5}
    assert "machine" in added


def test_other_settings_are_not_comparable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VELOX_BENCH_SMOKE", raising=False)
    fresh = _fresh({"contexts": [1024], "decode_steps": 2})
    with pytest.raises(ValueError, match="decode_steps is 2 now but 32 in the saved run"):
        add_rows(_saved(), fresh, ["new"], {})
    with pytest.raises(ValueError, match=r"no rows measured for \['absent'\]"):
        add_rows(_saved(), _fresh(), ["absent"], {})
    monkeypatch.setenv("VELOX_BENCH_SMOKE", "1")
    with pytest.raises(ValueError, match="real run"):
        add_rows(_saved(), _fresh(), ["new"], {})
