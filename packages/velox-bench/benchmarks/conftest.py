"""Velox benchmark session: OpenBLAS before mlx, per-suite results and figures at the end."""

from __future__ import annotations

# Must run before anything imports mlx: loading OpenBLAS later has no effect.
from velox_blas import preload_openblas

BLAS_DECISION = preload_openblas()

import json  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from velox_bench.results import SuiteResults  # noqa: E402

_SUITES: dict[str, SuiteResults] = {}


@pytest.fixture(scope="session")
def suite_results() -> Callable[[str], SuiteResults]:
    """``suite_results("micro")``: the session's results for one suite (rows, summary)."""

    def get(name: str) -> SuiteResults:
        return _SUITES.setdefault(name, SuiteResults(name))

    return get


@pytest.fixture(scope="session")
def embedded_model() -> None:
    """Skips a suite that serves the embedded model when it is not installed."""
    try:
        from velox_mlx_lm.embedded import default_model_path

        default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"the embedded model is needed: {exc}")


@pytest.fixture(autouse=True)
def _no_cross_test_arrays() -> Iterator[None]:
    yield
    import mlx.core as mx

    mx.clear_cache()


def pytest_report_header(config: pytest.Config) -> str:
    return f"velox-bench BLAS: {BLAS_DECISION}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write ``<suite>.json`` for every suite that measured something, then the figures.

    With ``VELOX_BENCH_ADD_ROWS=m1,m2`` the rows of those methods are added to the committed
    ``<suite>.json`` instead (``velox_bench.results.add_rows``): select them, and a baseline
    to compare the machine with, by ``-k`` (``-k "expected_attention or sdpa"``)."""
    suites = {name: s for name, s in _SUITES.items() if s.rows}
    if not suites:
        return
    from velox_bench.plots import plot_all
    from velox_bench.results import add_rows, adding_rows, blas_report, results_dir
    from velox_bench.summary import summarize
    from velox_bench.variants import model_methods

    blas: dict[str, Any] = blas_report()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    added = adding_rows()
    orders = {"model": model_methods()}  # test_variants checks the model rows' order
    for name, suite in suites.items():
        if added:
            path = results_dir() / f"{name}.json"
            saved = json.loads(path.read_text(encoding="utf-8"))
            merged = add_rows(saved, suite, added, blas, orders.get(name, ()))
            merged["summary"] = summarize(name, merged["rows"])
            path.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
        else:
            suite.summary = summarize(name, suite.rows)
            path = suite.write(blas)
        if reporter is not None:
            reporter.write_line(f"velox-bench: wrote {path}")
    for path in plot_all():
        if reporter is not None:
            reporter.write_line(f"velox-bench: wrote {path}")
