"""Prefill time of the embedded model with the full cache and TOVA(512), side by side.

    python -m velox_bench.probes.prefill_compare [--tokens 2048] [--chunk 512]

Random token ids, chunks like mlx-lm's prefill loop, each cache's state evaluated per chunk;
the best of two rounds per method, printed with its ratio to the full cache.
"""

# ruff: noqa: E402  (OpenBLAS must be loaded before mlx is imported, see below)

from __future__ import annotations

# velox_blas imports no mlx: OpenBLAS (Linux, when present) is loaded before mlx below.
import velox_blas

BLAS = velox_blas.preload_openblas()

import argparse
import time

import mlx.core as mx

from velox_bench.models import make_caches
from velox_bench.variants import FULL, ROTATING, reduced_model_methods
from velox_mlx_lm.embedded import load_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    model, _ = load_default()
    prompt = mx.random.randint(0, 40000, (1, args.tokens))
    # The model suite's TOVA rows (tova, tova_oneshot, tova_adapted) at its budget, and full.
    names = [m for m in reduced_model_methods() if m != ROTATING]
    best: dict[str, float] = {}
    for _ in range(2):
        for name in names:
            caches = make_caches(model, name)
            start = time.perf_counter()
            for s in range(0, args.tokens, args.chunk):
                model(prompt[:, s : s + args.chunk], cache=caches)
                mx.eval([c.state for c in caches])
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    print(f"BLAS: {BLAS}; {args.tokens} tokens in chunks of {args.chunk}")
    for name, t in best.items():
        print(f"{name:<16} {t:7.2f} s  {t / best[FULL]:.2f}x full")


if __name__ == "__main__":
    main()
