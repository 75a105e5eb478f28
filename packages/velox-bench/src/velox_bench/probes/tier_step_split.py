"""Where a decode step with a demoted tier spends its time (issue 49's step bound): one layer
at a real attention shape, the step split into its parts, beside float32 matmuls over as many
rows.

    python -m velox_bench.probes.tier_step_split [--bits 2] [--budget 512] [--rounds 30]

The layer: TOVA at ``--budget / 2`` float32 rows and a tier of ``--bits`` in the other half's
bytes (``velox_bench.quality.demote_tier.tier_rows``), 32 query / 8 KV heads, D 128, filled by
a prompt. Prints medians (milliseconds) of: the whole step, the attention over the main rows and
the tier, over the main rows alone, the tier's logits (keys per channel) and its values, the
demotion of one row, and float32 ``q @ K^T`` over the tier's row count and over the main rows'
(the same shapes without quantization): on a CPU the tier's rows cost about what float32 rows
cost per row, so a step with a tier costs about what its row count says.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from velox_bench.probes.timing import alternating_medians


def measure(bits: int, budget: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of each part (module docstring)."""
    from velox_blas import preload_openblas

    preload_openblas()
    import mlx.core as mx
    import numpy as np

    from velox_bench.quality.demote_tier import GROUP, tier_rows
    from velox_cache_core import POLICIES, Layer, TierSpec, demoted
    from velox_cache_core.store.tier import demote_one

    B, H_q, H_kv, D = 1, 32, 8, 128
    policy = POLICIES["tova"]
    n = tier_rows(budget, budget // 2, bits, D, 4)
    spec = TierSpec(bits, n, GROUP)
    layer = Layer(policy, policy.init(budget=budget // 2), None, demote=spec)
    rng = np.random.default_rng(0)

    def feed(L: int) -> Any:
        k = mx.array(rng.standard_normal((B, H_kv, L, D)).astype(np.float32))
        q = mx.array(rng.standard_normal((B, H_q, L, D)).astype(np.float32))
        layer.lay_out(k, k)
        return [layer.attend(q, D**-0.5), *layer.arrays()]

    for _ in range(0, budget + n + 64, 256):
        mx.eval(feed(256))
    mx.eval(feed(1))
    tier, step = layer.tier, layer.last
    assert tier is not None and step is not None
    q = mx.random.normal((B, H_q, 1, D))
    grouped = q.reshape(B, H_kv, H_q // H_kv, 1, D)
    row = mx.random.normal((B, H_kv, 1, D))
    at = mx.full((B, H_kv, 1), 10**6, dtype=mx.int32)
    from velox_cache_core.store import rows

    main = rows.dense(step.keys)  # float32 here: the main rows are not quantized
    dense = mx.random.normal((B, H_kv, tier.n_rows, D))
    probs = mx.ones((B, H_kv, H_q // H_kv, 1, tier.n_rows)) / tier.n_rows
    mx.eval(q, row, dense, probs)
    scale = D**-0.5
    parts: dict[str, Callable[[], Any]] = {
        "whole step": lambda: feed(1),
        "attention, main rows + tier": lambda: demoted.attend(q, step, tier, scale, None)[0],
        "attention, main rows only": lambda: demoted.attend(q, step, None, scale, None)[0],
        f"tier logits ({tier.n_rows} rows)": lambda: tier.keys.matmul(grouped, True),
        f"tier values ({tier.n_rows} rows)": lambda: tier.values.matmul(probs, False),
        "demote one row": lambda: demote_one(spec, tier, row, row, at, at).arrays(),
        f"float32 q @ K^T, {tier.n_rows} rows": lambda: (
            grouped @ dense[:, :, None].swapaxes(-1, -2)
        ),
        f"float32 q @ K^T, {int(main.shape[2])} rows": lambda: (
            grouped @ main[:, :, None].swapaxes(-1, -2)
        ),
    }
    return alternating_medians(parts, rounds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_bench.probes.tier_step_split")
    parser.add_argument("--bits", type=int, choices=(2, 4), default=2, help="tier width")
    parser.add_argument("--budget", type=int, default=512, help="rows at equal bytes (512)")
    parser.add_argument("--rounds", type=int, default=30, help="alternating rounds (30)")
    args = parser.parse_args(argv)
    if args.budget < 4 or args.budget % 2:
        parser.error(f"--budget must be an even int >= 4, got {args.budget}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    from velox_bench.quality.demote_tier import tier_rows

    if tier_rows(args.budget, args.budget // 2, args.bits, 128, 4) < 1:
        parser.error(f"--budget {args.budget} leaves the tier no rows: use 128 or more")
    result = measure(args.bits, args.budget, args.rounds)
    print(f"{'part':<40} {'ms (median)':>12}")
    for name, ms in result.items():
        print(f"{name:<40} {ms:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
