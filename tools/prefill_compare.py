"""Prefill time of the embedded model with the full cache and TOVA(512), side by side.

    python tools/prefill_compare.py [--tokens 2048] [--chunk 512]

Random token ids, chunks like mlx-lm's prefill loop, each cache's state evaluated per chunk;
the best of two rounds per method, printed with its ratio to the full cache.
"""

# ruff: noqa: E402  (velox_mlx_lm must be imported before mlx, see below)

from __future__ import annotations

# Importing velox_mlx_lm first loads OpenBLAS before mlx on Linux (when present); the
# statement below keeps import sorting from moving mlx above it.
import velox_mlx_lm

BLAS_NOTE = velox_mlx_lm.__version__

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.blas import blas_in_use
from velox_mlx_lm.embedded import load_default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    model, _ = load_default()
    prompt = mx.random.randint(0, 40000, (1, args.tokens))
    layers = len(model.layers)
    makers = {
        "full": lambda: [KVCache() for _ in range(layers)],
        "tova sequential": lambda: KVCacheBuilder.for_model(model, KVCacheConfig()),
        "tova oneshot": lambda: KVCacheBuilder.for_model(
            model, KVCacheConfig(tova_prefill="oneshot")
        ),
        "tova_adapted": lambda: KVCacheBuilder.for_model(
            model, KVCacheConfig(method="tova_adapted")
        ),
    }
    best: dict[str, float] = {}
    for _ in range(2):
        for name, make in makers.items():
            caches = make()
            start = time.perf_counter()
            for s in range(0, args.tokens, args.chunk):
                model(prompt[:, s : s + args.chunk], cache=caches)
                mx.eval([c.state for c in caches])
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    print(f"BLAS: {blas_in_use()}; {args.tokens} tokens in chunks of {args.chunk}")
    for name, t in best.items():
        print(f"{name:<16} {t:7.2f} s  {t / best['full']:.2f}x full")


if __name__ == "__main__":
    main()
