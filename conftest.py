"""Loaded by pytest before any test module: make OpenBLAS the BLAS of every test process.

MLX's Linux CPU wheel links a reference BLAS that runs the float32 embedded model several
times slower. ``velox_blas`` loads the system's OpenBLAS, when there is one, but only before
``mlx.core`` is first imported; the test packages' own conftest files and modules import mlx,
so the load has to happen here, first. Without OpenBLAS (or with only velox-cache-core
installed) nothing changes and the tests pass with the reference BLAS.

It also picks the Hypothesis profile: with ``CI`` set (``.ci/run`` sets it), examples are
derandomized, so a CI run is repeatable and cannot fail on an example no one has seen locally;
elsewhere every run draws new examples and keeps finding new cases.
"""

from __future__ import annotations

import os

try:
    from hypothesis import settings
except ImportError:  # sessions that run no property test (nox -s docs) do not install it
    pass
else:
    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")

try:
    import velox_blas
except ImportError:  # velox-mlx-lm not installed: the core's tests need no BLAS choice
    pass
else:
    velox_blas.preload_openblas()
