"""``nox -s bench -- WORDS``: which benchmark files a word selects (noxfile.bench_selection)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_selection():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("nox") is None:
        pytest.skip("nox is not installed")
    return _noxfile().bench_selection


@functools.cache
def _noxfile():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("velox_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("velox_noxfile", module)
    spec.loader.exec_module(module)
    return module


def test_quality_also_selects_its_variants() -> None:
    paths, args = bench_selection()(["quality"])
    assert [Path(p).name for p in paths] == [
        "test_quality.py",
        "test_allocation_quality.py",
        "test_kvzip_quality.py",
    ]
    assert args == []


def test_one_file_words_and_keywords() -> None:
    select = bench_selection()
    paths, args = select(["distributed", "-x", "-k", "smoke", "nosuchsuite"])
    assert [Path(p).name for p in paths] == ["test_distributed.py"]
    assert args == ["-x", "-k", "smoke", "-k", "nosuchsuite"]
