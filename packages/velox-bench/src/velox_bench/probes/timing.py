"""Timing for the probes: named pieces of MLX work, each evaluated in turn, round after round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def alternating_medians(parts: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each of ``parts`` (a thunk whose result is evaluated with
    ``mx.eval``), over ``rounds`` rounds that run every part once, in order: the parts see the
    same machine load, so their medians compare."""
    import mlx.core as mx

    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            began = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - began)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
