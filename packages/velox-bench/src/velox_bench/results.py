"""Compact per-suite results: machine info, medians and ratios, written as JSON at session end.

pytest-benchmark keeps every round in its own JSON; these files keep what the docs quote.
``VELOX_BENCH_RESULTS_DIR`` redirects them (the smoke test writes to a temporary directory).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REPO_ROOT",
    "SuiteResults",
    "add_rows",
    "adding_rows",
    "blas_report",
    "figures_dirs",
    "loglog_slope",
    "machine_info",
    "median_seconds",
    "results_dir",
    "save_figure",
    "smoke",
    "write_json",
]

REPO_ROOT = Path(__file__).resolve().parents[4]


def smoke() -> bool:
    """``VELOX_BENCH_SMOKE=1``: tiny sizes, one round (the code paths, not the numbers)."""
    return os.environ.get("VELOX_BENCH_SMOKE", "") not in ("", "0")


def results_dir() -> Path:
    return Path(os.environ.get("VELOX_BENCH_RESULTS_DIR") or REPO_ROOT / "benchmarks" / "results")


def write_json(name: str, results: dict[str, Any]) -> Path:
    """``<results dir>/<name>.json`` (indented), directories created."""
    path = results_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def save_figure(fig: Any, paths: Sequence[Path], dpi: int = 110) -> list[Path]:
    """Save matplotlib ``fig`` to every path (directories created), then close it."""
    import matplotlib.pyplot as plt

    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return list(paths)


def figures_dirs() -> list[Path]:
    """Where figures go: next to the results, and under docs/ for the site (real runs only)."""
    override = os.environ.get("VELOX_BENCH_RESULTS_DIR")
    if override:
        return [Path(override) / "figures"]
    return [REPO_ROOT / "benchmarks" / "figures", REPO_ROOT / "docs" / "figures"]


def machine_info() -> dict[str, Any]:
    from importlib.metadata import version

    import mlx.core as mx

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
    }
    try:
        with open("/proc/loadavg", encoding="utf-8") as f:
            info["loadavg_at_end"] = f.read().split()[:3]
    except OSError:
        pass
    return info


def _mapped_blas() -> list[str]:
    """BLAS libraries mapped into this process (Linux only; numpy's private copy excluded)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            names = {line.split()[-1] for line in maps if "blas" in line.lower()}
    except OSError:
        return []
    return sorted(n for n in names if "scipy_openblas" not in n)


def blas_report() -> dict[str, Any]:
    """Which BLAS runs, and evidence that it took effect: float32 matmul GFLOP/s in mlx.

    The reference BLAS of the mlx CPU wheel reaches a few GFLOP/s; OpenBLAS tens. The decision
    is :mod:`velox_blas`'s (load it first, before mlx: ``velox_blas.preload_openblas()``).
    """
    import mlx.core as mx  # here, not at the top: importing this module must not load mlx

    import velox_blas

    n = 512
    a = mx.random.normal((n, n))
    mx.eval(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - start)
    return {
        "blas_in_use": velox_blas.blas_in_use(),
        "mapped_blas_libraries": _mapped_blas(),
        "matmul_512_gflops": round(2 * n**3 / best / 1e9, 1),
    }


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x): the exponent of ``y ~ x^k``."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx_, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx_) ** 2 for x in lx)
    return (
        sum((x - mx_) * (y - my) for x, y in zip(lx, ly, strict=True)) / sxx
        if sxx
        else float("nan")
    )


@dataclass
class SuiteResults:
    """Rows (one per measured configuration) and a summary of one suite."""

    suite: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def write(self, blas: dict[str, Any], directory: Path | None = None) -> Path:
        directory = directory or results_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.suite}.json"
        payload = {
            "suite": self.suite,
            "machine": machine_info(),
            "blas": blas,
            "smoke": smoke(),
            "settings": self.settings,
            "summary": self.summary,
            "rows": self.rows,
        }
        path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n", encoding="utf-8")
        return path


ROW_IDENTITY = ("config", "phase", "context", "method")  # what a row measured, not how long


def adding_rows() -> list[str]:
    """``VELOX_BENCH_ADD_ROWS=m1,m2``: the methods whose rows a run adds to the committed
    results (see :func:`add_rows`); empty: the run writes its suites whole."""
    return [m for m in os.environ.get("VELOX_BENCH_ADD_ROWS", "").split(",") if m]


def _check_comparable(saved: dict[str, Any], fresh: SuiteResults, methods: Sequence[str]) -> None:
    """``ValueError`` unless ``fresh`` is a real run of ``saved``'s settings measuring every one
    of ``methods``."""
    if saved.get("smoke") or smoke():
        raise ValueError("rows are added to a real run, with a real run")
    for key, value in fresh.settings.items():
        if json.loads(json.dumps(value)) != saved["settings"].get(key):
            raise ValueError(
                f"{fresh.suite} setting {key} is {value!r} now but "
                f"{saved['settings'].get(key)!r} in the saved run: not comparable"
            )
    missing = [m for m in methods if not any(r["method"] == m for r in fresh.rows)]
    if missing:
        raise ValueError(f"{fresh.suite}: no rows measured for {missing}")


def _row_key(row: dict[str, Any]) -> str:
    return " ".join(str(row[k]) for k in ROW_IDENTITY if k in row)


def _drift(saved: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> dict[str, float]:
    """Each baseline row's seconds now over its saved seconds, by row."""
    before = {_row_key(r): r["seconds"] for r in saved}
    return {
        _row_key(r): r["seconds"] / before[_row_key(r)] for r in baselines if _row_key(r) in before
    }


def _in_order(rows: list[dict[str, Any]], order: Sequence[str]) -> list[dict[str, Any]]:
    """``rows`` as they are if their methods first appear as in ``order`` (methods not in it
    after those in it), else stably sorted by method that way."""
    rank = {m: i for i, m in enumerate(order)}
    present = list(dict.fromkeys(r["method"] for r in rows))
    if present == sorted(present, key=lambda m: rank.get(m, len(rank))):
        return rows
    return sorted(rows, key=lambda r: rank.get(r["method"], len(rank)))


def add_rows(
    saved: dict[str, Any],
    fresh: SuiteResults,
    methods: Sequence[str],
    blas: dict[str, Any],
    order: Sequence[str] = (),
) -> dict[str, Any]:
    """``saved`` (a committed ``<suite>.json``) with the rows of ``methods`` measured now by
    ``fresh`` put in, without rerunning the whole suite.

    The run must use the saved settings (else ``ValueError``: the rows would not be
    comparable). Saved rows of ``methods`` are replaced, new ones go last, and the rows are
    reordered by method only where ``order`` says otherwise (:func:`_in_order`). ``fresh`` rows of
    other methods are not added: they are the run's baselines, and ``added_rows`` records each
    one's median time now over its saved time (the drift of the machine between the two runs)
    with the run's machine, BLAS and methods. The summary is computed again by the caller.
    """
    _check_comparable(saved, fresh, methods)
    drift = _drift(saved["rows"], [r for r in fresh.rows if r["method"] not in methods])
    kept = [r for r in saved["rows"] if r["method"] not in methods]
    new = [r for r in fresh.rows if r["method"] in methods]
    rows = _in_order(kept + new, order)
    out: dict[str, Any] = json.loads(json.dumps({**saved, "rows": rows}, default=_jsonable))
    out.setdefault("added_rows", []).append(
        {
            "methods": list(methods),
            "machine": machine_info(),
            "blas": blas,
            "baseline_seconds_now_over_saved": drift,
        }
    )
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


def median_seconds(benchmark: Any) -> float | None:
    """The median round of a pytest-benchmark fixture, ``None`` under ``--benchmark-disable``."""
    stats = getattr(benchmark, "stats", None)
    if stats is None:
        return None
    return float(stats.stats.median)
