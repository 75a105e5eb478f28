"""Load OpenBLAS before mlx, without importing ``velox_mlx_lm`` (its ``__init__`` imports mlx).

``velox_mlx_lm.blas.preload_openblas`` only helps before the first ``import mlx.core``, but
``import velox_mlx_lm.blas`` runs the package ``__init__``, which imports mlx-lm and so mlx.
This module executes ``blas.py`` from its file and registers it as ``velox_mlx_lm.blas``, so the
decision it records is the one ``velox_mlx_lm.blas.blas_in_use()`` reports later.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["blas_report", "preload"]

_MODULE = "velox_mlx_lm.blas"


def _blas_module() -> ModuleType:
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    package = importlib.util.find_spec("velox_mlx_lm")  # locates, does not import
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("velox_mlx_lm is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "blas.py"
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    spec.loader.exec_module(module)
    return module


def preload() -> str:
    """Load OpenBLAS if mlx is not imported yet; return the decision (see ``blas_in_use``)."""
    return str(_blas_module().preload_openblas())


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

    The reference BLAS of the mlx CPU wheel reaches a few GFLOP/s; OpenBLAS tens.
    """
    import mlx.core as mx

    n = 512
    a = mx.random.normal((n, n))
    mx.eval(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - start)
    return {
        "blas_in_use": str(_blas_module().blas_in_use()),
        "mapped_blas_libraries": _mapped_blas(),
        "matmul_512_gflops": round(2 * n**3 / best / 1e9, 1),
    }
