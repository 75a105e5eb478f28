"""Load OpenBLAS before mlx, and report which BLAS ran.

:mod:`velox_blas` (shipped with ``velox-mlx-lm``) imports no mlx, so importing this module
does not either; ``velox_mlx_lm.blas`` re-exports the same functions, so the decision
:func:`preload` records is the one ``velox_mlx_lm.blas.blas_in_use()`` reports later.
"""

from __future__ import annotations

import time
from typing import Any

import velox_blas

__all__ = ["blas_report", "preload"]


def preload() -> str:
    """Load OpenBLAS if mlx is not imported yet; return the decision (see ``blas_in_use``)."""
    return velox_blas.preload_openblas()


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
    import mlx.core as mx  # here, not at the top: importing this module must not load mlx

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
