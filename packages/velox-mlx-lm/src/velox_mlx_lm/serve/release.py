"""``velox-serve``'s process memory: freed buffers go back to the operating system.

MLX allocates its buffers with ``malloc`` on a CPU. glibc's ``malloc`` keeps a freed chunk in
its heap, still resident, unless the chunk was mapped on its own (at or above the mmap
threshold, which glibc raises up to 32 MiB as large chunks are freed) or sits at the top of
the heap. A server frees prefill activations of a few MiB each between long-lived arrays
(weights, prompt-cache entries), so the heap's free bytes grow and stay resident: in a soak
of 4 agent conversations they reached 0.6 GB while MLX's own use stayed flat, and the RSS
followed them (docs/serving.md, "Process memory"). Two steps keep it down:

- :func:`configure_allocator`, at start: a fixed mmap threshold, so that every buffer of
  ``MMAP_THRESHOLD`` bytes or more is mapped on its own and unmapped when MLX frees it;
- :class:`Releaser`, when a sequence ends: MLX's buffer cache emptied (``mx.clear_cache``),
  then ``malloc_trim(0)`` returns the free pages left inside the heap (the smaller chunks), at
  most once per ``interval_s``.

Both need glibc (Linux); elsewhere they do nothing but ``mx.clear_cache`` (on a Mac, MLX's own
pool holds the Metal buffers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time
from typing import Any

import mlx.core as mx

MMAP_THRESHOLD = 1 << 20  # bytes: buffers this large are mapped on their own
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
RELEASE_INTERVAL_S = 1.0  # the least time between two trims (a trim takes ~5-40 ms here)


def glibc() -> Any | None:
    """glibc's C library, or None on another platform or C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None  # musl and others: no malloc_trim
    return libc


def configure_allocator(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (this also stops glibc raising it);
    True if it was set. Call it before the model is loaded."""
    libc = glibc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1)


def describe(configured: bool) -> str:
    """The log line's words for what :func:`configure_allocator` returned."""
    if configured:
        return (
            f"buffers of {MMAP_THRESHOLD >> 20} MiB and more are unmapped when freed; the "
            "heap is trimmed when sequences end"
        )
    return "MLX's buffer cache is emptied when sequences end (no glibc: no heap trim)"


class Releaser:
    """Gives back what a finished sequence freed: ``release()`` empties MLX's buffer cache and
    trims the C heap, at most once per ``interval_s`` (a call sooner does nothing)."""

    def __init__(self, interval_s: float = RELEASE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.libc = glibc()
        self.lock = threading.Lock()
        self.last = -float("inf")
        self.releases = 0

    def release(self, force: bool = False) -> bool:
        now = time.monotonic()
        with self.lock:
            if not force and now - self.last < self.interval_s:
                return False
            self.last = now
            self.releases += 1
        mx.clear_cache()
        if self.libc is not None:
            self.libc.malloc_trim(0)
        return True
