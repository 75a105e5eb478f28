"""Memory for the probes: what dropping an object frees in MLX's active memory."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def freed_by_dropping(box: list[Any], report: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``report(box[0])``, read with everything evaluated, plus ``held``: the MLX active memory
    freed by dropping ``box[0]`` (the box is emptied; the caller keeps no other reference)."""
    import mlx.core as mx

    mx.synchronize()
    gc.collect()
    alive = mx.get_active_memory()
    out = report(box[0])
    box.clear()  # nothing holds the object now
    gc.collect()
    mx.synchronize()
    return {**out, "held": alive - mx.get_active_memory()}


@contextmanager
def without_buffer_cache() -> Iterator[None]:
    """MLX's buffer cache emptied and off inside (``set_cache_limit(0)``), its limit restored
    after: arrays made inside get buffers of their own size, not a recycled larger one (MLX's
    CPU allocator hands an array of ``n`` bytes any cached buffer under ``min(2n, n + 8 KiB)``
    and counts all of it as active memory)."""
    import mlx.core as mx

    previous = mx.set_cache_limit(0)
    mx.clear_cache()  # buffers cached before would still be handed out
    try:
        yield
    finally:
        mx.set_cache_limit(previous)
