"""What a layer with a demoted tier really holds after steady decode steps (issue 49's memory
bound): MLX active memory with the layer alive, less without it, beside what it reports.

    python -m velox_bench.probes.tier_memory [--budget 256] [--tier-rows 1500] [--steps 100]

One layer (32 query / 8 KV heads, D 128, float32), TOVA and H2O, tiers of 2 and 4 bits, with the
undo log off (``trim_window=0``) and on (16): a prompt of 2,048 tokens, ``--steps`` decode steps,
then ``held`` (active memory freed by dropping the layer) against ``nbytes`` (main rows and
tier), the undo log's ``nbytes``, and ``TierSpec.max_nbytes`` (the bound ``velox-serve``
counts once more for the tier before the last call). Each case runs twice: keeping what the
last call attended over until the next call (the call's ``retained + new`` rows and the tier it
saw, for layers that share this one's keys: ``release`` no) and dropping them once attended
(``Layer.release``, what ``PolicyKVCache`` does when its model shares no layer's rows).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from velox_bench.probes.held import freed_by_dropping


def measure(
    method: str, bits: int, window: int, budget: int, rows: int, steps: int, release: bool = True
) -> dict[str, Any]:
    """One layer's figures (module docstring); ``release``: drop the copies after each call
    (``Layer.release``, what a cache of a model without KV sharing does)."""
    from velox_blas import preload_openblas

    preload_openblas()
    import mlx.core as mx
    import numpy as np

    from velox_cache_core import POLICIES, Layer, TierSpec, new_log

    B, H_q, H_kv, D = 1, 32, 8, 128
    rng = np.random.default_rng(0)
    policy = POLICIES[method]
    spec = TierSpec(bits, rows, 64)
    log = new_log(window) if window else None
    layer: Any = Layer(policy, policy.init(budget=budget), log, demote=spec)

    def feed(L: int) -> None:
        k = mx.array(rng.standard_normal((B, H_kv, L, D)).astype(np.float32))
        q = mx.array(rng.standard_normal((B, H_q, L, D)).astype(np.float32))
        layer.lay_out(k, k)
        out = layer.attend(q, D**-0.5)
        mx.eval(out, layer.arrays(), *([] if layer.tier is None else layer.tier.arrays()))
        if release:
            layer.release()

    for _ in range(8):
        feed(256)
    for _ in range(steps):
        feed(1)
    bound = spec.max_nbytes(H_kv, D, 4)
    box, layer = [layer], None  # the box holds the only reference (feed's too)

    def report(held: Any) -> dict[str, Any]:
        nbytes = held.view().nbytes + (0 if held.tier is None else held.tier.nbytes)
        return {"nbytes": nbytes, "log": 0 if held.log is None else held.log.nbytes}

    r = freed_by_dropping(box, report)
    held, nbytes, log_bytes = r["held"], r["nbytes"], r["log"]
    return {
        "method": method,
        "bits": bits,
        "trim_window": window,
        "release": release,
        "held": held,
        "nbytes": nbytes,
        "log": log_bytes,
        "tier_bound": bound,
        "held / (nbytes + log)": held / (nbytes + log_bytes),
        "held / (nbytes + log + tier bound)": held / (nbytes + log_bytes + bound),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_bench.probes.tier_memory")
    parser.add_argument("--budget", type=int, default=256, help="main rows (default 256)")
    parser.add_argument("--tier-rows", type=int, default=1500, help="tier rows (default 1500)")
    parser.add_argument("--steps", type=int, default=100, help="decode steps (default 100)")
    args = parser.parse_args(argv)
    for name, value in (("--budget", args.budget), ("--tier-rows", args.tier_rows),
                        ("--steps", args.steps)):  # fmt: skip
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    head = ("method", "bits", "window", "release", "held MB", "nbytes MB", "log MB",
            "held/(n+log)", "held/(n+log+tier)")  # fmt: skip
    print(" ".join(f"{h:>15}" for h in head))
    for method in ("tova", "h2o"):
        for bits in (2, 4):
            for window, release in ((w, r) for w in (0, 16) for r in (False, True)):
                r = measure(method, bits, window, args.budget, args.tier_rows, args.steps, release)
                cells = (method, bits, window, "yes" if release else "no",
                         f"{r['held'] / 1e6:.2f}",
                         f"{r['nbytes'] / 1e6:.2f}", f"{r['log'] / 1e6:.2f}",
                         f"{r['held / (nbytes + log)']:.2f}",
                         f"{r['held / (nbytes + log + tier bound)']:.2f}")  # fmt: skip
                print(" ".join(f"{c!s:>15}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
