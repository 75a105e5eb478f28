"""One MLP-sized matmul per dtype on this machine's MLX backend: why the real-shape suite's
bfloat16 rows are or are not affordable here.

``[2048, 2048] @ [2048, 8192]`` (the hidden x MLP product of the real-shape model), evaluated
``--reps`` times per dtype after one warm-up; the best time and the ratio to float32.

    python -m velox_bench.probes.matmul_dtypes [--reps 3]
"""

from __future__ import annotations

import argparse
import time

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"BLAS: {BLAS}; device: {mx.default_device()}")
    best: dict[str, float] = {}
    for name, dtype in DTYPES.items():
        a = mx.random.normal((2048, 2048)).astype(dtype)
        b = mx.random.normal((2048, 8192)).astype(dtype)
        mx.eval(a, b, a @ b)  # warm-up
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    print(f"{'dtype':10}{'best s':>10}{'vs float32':>12}")
    for name, seconds in best.items():
        print(f"{name:10}{seconds:10.3f}{seconds / best['float32']:12.1f}")


if __name__ == "__main__":
    main()
