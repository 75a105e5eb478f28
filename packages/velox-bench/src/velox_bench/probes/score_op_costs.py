"""What each op of a windowed decode step's scoring costs, one op at a time.

At a real model's attention (32 query / 8 KV heads, head_dim 128, 513 candidates) and
MorphKV's default window of 8 probe rows, every op below is evaluated on its own inputs
(already evaluated) 200 times; the medians show where MorphKV's decode step goes next to
TOVA's single row and one ``mx.fast.scaled_dot_product_attention`` call.

    python -m velox_bench.probes.score_op_costs [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402

from velox_cache_core.scoring import grouped_logits, masked_softmax, softmax  # noqa: E402
from velox_cache_core.sequential import fuse_rows, row_visibility  # noqa: E402

B, H_Q, H_KV, D, N, WINDOW = 1, 32, 8, 128, 513, 8
LOG2_E = 1.4426950408889634


def median_ms(op: Callable[[], mx.array], reps: int) -> float:
    for _ in range(10):
        mx.eval(op())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(op())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    keys = mx.random.normal((B, H_KV, N, D))
    rows = mx.random.normal((B, H_Q, WINDOW, D))
    one = rows[:, :, -1:]
    positions = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (B, 1, N))
    row_positions = mx.arange(N - WINDOW, N, dtype=mx.int32)
    logits = grouped_logits(rows, keys, D**-0.5, "layer")
    visible = row_visibility(positions, row_positions)[:, :, None]
    masked = mx.where(visible, logits, -mx.inf)
    weights = masked_softmax(logits, visible)
    mx.eval(keys, rows, one, positions, row_positions, logits, visible, masked, weights)
    ops: dict[str, Callable[[], mx.array]] = {
        "logits, 1 row": lambda: grouped_logits(one, keys, D**-0.5, "layer"),
        f"logits, {WINDOW} rows": lambda: grouped_logits(rows, keys, D**-0.5, "layer"),
        "softmax, 1 row": lambda: softmax(logits[:, :, :, -1:]),
        f"masked softmax, {WINDOW} rows": lambda: masked_softmax(logits, visible),
        f"  2**x alone, {WINDOW} rows": lambda: mx.power(2.0, masked * LOG2_E),
        f"  mx.exp alone, {WINDOW} rows": lambda: mx.exp(masked),
        f"  mx.softmax, {WINDOW} rows": lambda: mx.softmax(masked, axis=-1),
        "visibility mask": lambda: row_visibility(positions, row_positions),
        "head mean + row fusion": lambda: fuse_rows(weights.mean(axis=2), "mean"),
        "SDPA, 1 query row": lambda: mx.fast.scaled_dot_product_attention(
            one, keys, keys, scale=D**-0.5
        ),
    }
    print(f"BLAS: {BLAS}; device: {mx.default_device()}; {args.reps} evaluations per op")
    print(f"{'op':34}{'median ms':>12}")
    for name, op in ops.items():
        print(f"{name:34}{median_ms(op, args.reps):12.3f}")


if __name__ == "__main__":
    main()
