"""What a speculative verify round costs with a Velox cache, against the full cache.

    python -m velox_bench.probes.verify_chunk_compare [--rounds 9] [--steps 10] [--budget 256]

The embedded model holds a 600-token prompt and one decode step. Each round then feeds a verify
chunk of 4 tokens (3 draft tokens and the last accepted one, as mlx-lm's speculative decoding
does) and trims 3 of them (every draft rejected), ``--steps`` times; rounds alternate between
the full cache, TOVA at ``--budget`` with short chunks run as decode steps (the default), and
TOVA with them through the general chunk path (``velox_cache_core.in_flight.STEPPED_CHUNK = 1``).
Prints the median time per verify-and-trim and its ratio to the full cache's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402

import velox_cache_core.in_flight as layer_module  # noqa: E402
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402

KINDS = {"full": 16, "tova, steps": 16, "tova, chunk path": 1}  # kind -> STEPPED_CHUNK


def ready(model: Any, kind: str, budget: int) -> list[Any]:
    """Caches holding a 600-token prompt and one decode step (a steady store)."""
    if kind == "full":
        caches = make_prompt_cache(model)
    else:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", tova_budget=budget))
    ids = mx.array([list(range(1000, 1600))])
    for part in (ids, ids[:, :1]):
        model(part, cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def verify_rounds(model: Any, caches: list[Any], steps: int) -> float:
    """Seconds per verify chunk of 4 tokens followed by a trim of 3."""
    chunk = mx.array([[5, 6, 7, 8]])
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(chunk, cache=caches))
        trim_prompt_cache(caches, 3)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budget", type=int, default=256)
    args = parser.parse_args(argv)
    model, _ = load_default()
    caches = {kind: ready(model, kind.split(",")[0], args.budget) for kind in KINDS}
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    before = layer_module.STEPPED_CHUNK
    try:
        for _ in range(args.rounds):
            for kind, limit in KINDS.items():
                layer_module.STEPPED_CHUNK = limit
                times[kind].append(verify_rounds(model, caches[kind], args.steps))
    finally:
        layer_module.STEPPED_CHUNK = before
    full = statistics.median(times["full"])
    print(f"BLAS: {BLAS}; verify chunk of 4, trim 3; medians of {args.rounds} rounds")
    for kind in KINDS:
        ms = statistics.median(times[kind])
        print(f"{kind:<18} {ms * 1000:8.1f} ms  {ms / full:5.2f}x full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
