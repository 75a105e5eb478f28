"""Pick a fast BLAS for mlx on Linux CPU before mlx is imported.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, about 2.5 GFLOP/s. Loading OpenBLAS
into the process with ``RTLD_GLOBAL`` before the first ``import mlx.core`` makes libmlx bind
``cblas_sgemm`` to it (float32 models run ~20x faster); loading it later has no effect.

A top-level package of the ``velox-mlx-lm`` distribution, outside the ``velox_mlx_lm`` package
(whose ``__init__`` imports mlx-lm and so mlx): ``import velox_blas`` imports only the standard
library, so it can run first. ``import velox_mlx_lm`` calls :func:`preload_openblas` itself
(the same decision: one per process); code that must load OpenBLAS before mlx (``python -m``
entry points, benchmarks) imports this package directly, first.

Once it has loaded OpenBLAS, the module also stops OpenBLAS's worker threads at interpreter exit
(:func:`shutdown_openblas`, registered with :mod:`atexit`), after MLX's streams have finished.
Left to itself, OpenBLAS does that in its ELF destructor, during ``exit()``, whatever MLX's
stream thread is doing; if that thread is inside a multithreaded BLAS call (mlx-lm evaluates one
decode step ahead and nothing waits for it on the CPU), the worker overwrites the destructor's
stop signal with "task done", goes back to sleep, and the destructor joins it forever (issue 50).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import sys

__version__ = "0.12.0"

__all__ = ["blas_in_use", "preload_openblas", "shutdown_openblas"]

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_decision: str | None = None
_loaded: ctypes.CDLL | None = None  # the OpenBLAS this module loaded, if it did
_stopped = False  # shutdown_openblas() has stopped its threads


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
    global _decision, _loaded
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
                _loaded = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _decision = f"OpenBLAS ({path})"
            # Registered now, before mlx is imported, so it runs after the handlers that code
            # importing mlx registers (atexit runs them last in, first out).
            atexit.register(shutdown_openblas)
            break
    return _decision


def _synchronize_mlx() -> None:
    """Wait for the MLX streams that can hold BLAS work at exit; imports nothing.

    The main thread's default CPU stream, and mlx-lm's ``generation_stream`` (the stream
    ``stream_generate`` runs on: its last decode step is still being evaluated when the loop
    stops, and on the CPU mlx-lm does not wait for it). Streams other code makes on other threads
    are that code's to wait for.
    """
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return
    streams: list[object] = [mx.cpu]
    generate = sys.modules.get("mlx_lm.generate")
    if generate is not None and hasattr(generate, "generation_stream"):
        streams.append(generate.generation_stream)
    for stream in streams:
        # A stream whose task failed raises here; nothing is running on it then.
        with contextlib.suppress(Exception):
            mx.synchronize(stream)


def shutdown_openblas() -> bool:
    """Stop OpenBLAS's worker threads at a point where no BLAS call is running.

    Registered with :mod:`atexit` when :func:`preload_openblas` loads OpenBLAS. In order: (1)
    OpenBLAS is set to one thread, so a BLAS call that starts from now on runs on its caller and
    neither uses nor restarts the pool; (2) MLX's streams are waited for (see
    :func:`_synchronize_mlx`), so the calls already running finish; (3) ``blas_thread_shutdown_``
    wakes each idle worker and joins it. OpenBLAS's own destructor then finds no pool and returns
    at once. Returns whether the pool was shut down here (``False``: this module loaded no
    OpenBLAS, or that build lacks the symbols). Safe to call more than once; after it, BLAS runs
    single-threaded, so call it only when the process is done computing.
    """
    global _stopped
    lib = _loaded
    if lib is None:
        return False
    if _stopped:
        return True
    try:
        set_threads, stop = lib.openblas_set_num_threads, lib.blas_thread_shutdown_
    except AttributeError:
        return False
    set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
    stop.argtypes, stop.restype = [], ctypes.c_int
    # One thread first: setting the count on a stopped pool would start it again.
    set_threads(1)
    _synchronize_mlx()
    stop()
    _stopped = True
    return True


def blas_in_use() -> str:
    """The last decision of :func:`preload_openblas`; loads nothing itself."""
    if _decision is not None:
        return _decision
    return _fixed_blas() or "default (preload_openblas() was not called)"
