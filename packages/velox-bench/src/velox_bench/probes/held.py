"""Memory for the probes: what dropping an object frees in MLX's active memory."""

from __future__ import annotations

import gc
from collections.abc import Callable
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
