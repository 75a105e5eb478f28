"""What one compact-positions shift costs a layer (issue 49, point 5): the main rows at full
precision, the main rows quantized per token, and a demoted tier, side by side.

    python -m velox_bench.probes.shift_cost [--heads 3] [--dim 64] [--rows 513]
        [--tier-rows 1000] [--rounds 40]

A shift rotates every kept key once more (``velox_cache_core.store.rope_shift``): full-precision
keys directly, quantized keys through dequantize, rotate, quantize (per token for the main rows,
per channel at the tier's width for the tier). The defaults are one SmolLM2-sized layer (3 KV
heads, D 64, budget 512 plus the dead slot). Prints the median of ``--rounds`` alternating
rounds of each, in milliseconds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from velox_bench.probes.timing import alternating_medians


def measure(heads: int, dim: int, rows: int, tier_rows: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per shift of each store."""
    from velox_blas import preload_openblas

    preload_openblas()
    import mlx.core as mx

    from velox_cache_core.store.rope_shift import Rope, rotate_rows, rotate_tier
    from velox_cache_core.store.tier import TierSpec, demote
    from velox_cache_core.store.token_rows import Quant

    mx.random.seed(0)
    rope = Rope(dims=dim, base=100_000.0)
    shape = (1, heads, rows, dim)
    main = mx.random.normal(shape)
    main_q8 = Quant(8, 64).quantize(main)
    moves = mx.random.randint(0, rows, (1, heads, rows)).astype(mx.int32)
    tier_shape = (1, heads, tier_rows, dim)
    tier_moves = mx.random.randint(0, rows, (1, heads, tier_rows)).astype(mx.int32)
    at = mx.broadcast_to(mx.arange(tier_rows, dtype=mx.int32), tier_shape[:3])
    tiers = {}
    for bits in (2, 4):
        k, v = mx.random.normal(tier_shape), mx.random.normal(tier_shape)
        tier = demote(TierSpec(bits, tier_rows, 64), None, k, v, at, mx.zeros(tier_shape[:3]))
        assert tier is not None
        mx.eval(tier.arrays())
        tiers[bits] = tier
    cases: dict[str, Callable[[], Any]] = {
        f"main rows, float32 ({rows})": lambda: rotate_rows(main, moves, rope),
        f"main rows, 8-bit per token ({rows})": lambda: rotate_rows(main_q8, moves, rope).arrays(),
        f"tier, 2-bit ({tier_rows})": lambda: rotate_tier(tiers[2], tier_moves, rope).arrays(),
        f"tier, 4-bit ({tier_rows})": lambda: rotate_tier(tiers[4], tier_moves, rope).arrays(),
    }
    return alternating_medians(cases, rounds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_bench.probes.shift_cost")
    parser.add_argument("--heads", type=int, default=3, help="KV heads (default 3)")
    parser.add_argument("--dim", type=int, default=64, help="head dim (default 64)")
    parser.add_argument("--rows", type=int, default=513, help="main rows (default 513)")
    parser.add_argument("--tier-rows", type=int, default=1000, help="tier rows (default 1000)")
    parser.add_argument("--rounds", type=int, default=40, help="alternating rounds (default 40)")
    args = parser.parse_args(argv)
    for name, value in (("--heads", args.heads), ("--dim", args.dim), ("--rows", args.rows),
                        ("--tier-rows", args.tier_rows), ("--rounds", args.rounds)):  # fmt: skip
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.dim % 64:
        parser.error(f"--dim must be a multiple of 64 (the quantization group), got {args.dim}")
    result = measure(args.heads, args.dim, args.rows, args.tier_rows, args.rounds)
    print(f"{'store':<36} {'ms per shift (median)':>22}")
    for name, ms in result.items():
        print(f"{name:<36} {ms:>22.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
