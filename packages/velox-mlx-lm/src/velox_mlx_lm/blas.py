"""The BLAS loader, kept importable here for compatibility: it lives in :mod:`velox_blas`.

``velox_blas`` is a top-level package (importing it imports no mlx), so code that must load
OpenBLAS before mlx imports it directly; these are the same functions and the same decision.
"""

from velox_blas import blas_in_use, preload_openblas, shutdown_openblas

__all__ = ["blas_in_use", "preload_openblas", "shutdown_openblas"]
