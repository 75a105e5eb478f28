"""Pick a fast BLAS for mlx on Linux CPU before mlx is imported.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, about 2.5 GFLOP/s. Loading OpenBLAS
into the process with ``RTLD_GLOBAL`` before the first ``import mlx.core`` makes libmlx bind
``cblas_sgemm`` to it (float32 models run ~20x faster); loading it later has no effect.

A top-level package of the ``velox-mlx-lm`` distribution, outside the ``velox_mlx_lm`` package
(whose ``__init__`` imports mlx-lm and so mlx): ``import velox_blas`` imports only the standard
library, so it can run first. ``import velox_mlx_lm`` calls :func:`preload_openblas` itself
(the same decision: one per process); code that must load OpenBLAS before mlx (``python -m``
entry points, benchmarks) imports this package directly, first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__version__ = "0.6.0"

__all__ = ["blas_in_use", "preload_openblas"]

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_decision: str | None = None


def _candidates() -> list[str]:
    paths = [
        os.environ.get("MLX_CBLAS_LIB", ""),
        *_CANDIDATES,
        ctypes.util.find_library("openblas"),
    ]
    return [p for p in paths if p]


def _fixed_blas() -> str | None:
    """The BLAS that runs whatever this module does, if that is already settled."""
    if sys.platform == "darwin":
        return "Accelerate"
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"OpenBLAS (LD_PRELOAD={os.environ['LD_PRELOAD']})"
    return None


def preload_openblas() -> str:
    """Load OpenBLAS globally if ``mlx.core`` is not imported yet; say which BLAS will run.

    Looks at ``$MLX_CBLAS_LIB`` first, then the usual system paths. Safe to call any number of
    times and on any platform. Returns ``"OpenBLAS (<path>)"``, ``"Accelerate"`` (macOS),
    ``"default (mlx was already imported)"`` or ``"default (no OpenBLAS found)"``.
    """
    global _decision
    if _decision is not None and (_decision.startswith("OpenBLAS") or "mlx.core" in sys.modules):
        return _decision  # the first decision holds once mlx is loaded
    fixed = _fixed_blas()
    if fixed is not None:
        _decision = fixed
    elif "mlx.core" in sys.modules:
        _decision = "default (mlx was already imported)"
    else:
        _decision = "default (no OpenBLAS found)"
        for path in _candidates():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _decision = f"OpenBLAS ({path})"
            break
    return _decision


def blas_in_use() -> str:
    """The last decision of :func:`preload_openblas`; loads nothing itself."""
    if _decision is not None:
        return _decision
    return _fixed_blas() or "default (preload_openblas() was not called)"
