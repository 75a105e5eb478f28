"""What each method's caches really hold after steady decode steps, beside what they report:
MLX active memory freed by dropping them against their ``held_nbytes`` (rows, positions, the
policy's running arrays, the undo log) and the undo log's ``undo_nbytes``.

    python -m velox_bench.probes.undo_memory [--budget 256] [--steps 24] [--methods ...]
        [--kv-bits 8] [--no-buffer-cache]

A 2-layer llama with 32 query / 8 KV heads of 128 (float32, random weights): a 512-token prompt
in chunks of 128, then ``--steps`` decode steps with mlx-lm's generate loop's reads, through
``KVCacheBuilder`` caches with the default undo log (``trim_window`` 16).

MLX's CPU allocator keeps freed buffers (up to 32 MB) and gives a new array of ``n`` bytes any
cached buffer smaller than ``min(2n, n + 8 KiB)``, counting the whole buffer as active memory;
so what a cache holds also depends on what the process freed before. ``--no-buffer-cache``
(``mx.set_cache_limit(0)``) measures the caches' own arrays.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from typing import Any

from velox_blas import preload_openblas

preload_openblas()  # before mlx is imported

from velox_bench.probes.held import freed_by_dropping, without_buffer_cache  # noqa: E402

METHODS = ("tova", "h2o", "streaming_llm", "snapkv", "morphkv", "expected_attention")


def measure(method: str, budget: int = 256, steps: int = 24, kv_bits: int = 0) -> dict[str, Any]:
    """One method's figures (module docstring)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models import llama

    from velox_cache_core import policy_for_method
    from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=1024, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=128,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    prompt = 512
    tokens = mx.array(
        np.random.default_rng(0).integers(0, 128, (1, prompt + steps)), dtype=mx.int32
    )
    policy = policy_for_method(method).name
    settings: dict[str, Any] = {f"{policy}_budget": budget}
    config = KVCacheConfig(method=method, **settings)
    if kv_bits:
        config = config.replace(kv_bits=kv_bits)
    caches: Any = KVCacheBuilder.for_model(model, config)
    for s in range(0, prompt, 128):
        mx.eval(model(tokens[:, s : s + 128], cache=caches))
    for t in range(prompt, prompt + steps):
        mx.eval(model(tokens[:, t : t + 1], cache=caches), [c.state for c in caches])
    box = [caches]
    caches = None  # the box holds the only reference
    r = freed_by_dropping(
        box,
        lambda held: {
            "held_nbytes": sum(c.held_nbytes for c in held),
            "nbytes": sum(c.nbytes for c in held),
            "undo_nbytes": sum(c.undo_nbytes for c in held),
        },
    )
    return {
        "method": method,
        "kv_bits": kv_bits,
        **r,
        "held / held_nbytes": r["held"] / r["held_nbytes"],
        "held / nbytes": r["held"] / r["nbytes"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_bench.probes.undo_memory")
    parser.add_argument("--budget", type=int, default=256, help="rows per KV head (default 256)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps (default 24)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument("--kv-bits", type=int, default=0, help="quantized rows (0: float32)")
    parser.add_argument(
        "--no-buffer-cache", action="store_true", help="MLX's buffer cache off (set_cache_limit 0)"
    )
    args = parser.parse_args(argv)
    cache = without_buffer_cache() if args.no_buffer_cache else contextlib.nullcontext()
    for name, value in (("--budget", args.budget), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    head = ("method", "held MB", "held_nbytes MB", "undo MB", "held/held_nbytes", "held/nbytes")
    print(" ".join(f"{h:>18}" for h in head))
    with cache:
        for method in (m for m in args.methods.split(",") if m):
            r = measure(method, args.budget, args.steps, args.kv_bits)
            cells = (method, f"{r['held'] / 1e6:.2f}", f"{r['held_nbytes'] / 1e6:.2f}",
                     f"{r['undo_nbytes'] / 1e6:.2f}", f"{r['held / held_nbytes']:.2f}",
                     f"{r['held / nbytes']:.2f}")  # fmt: skip
            print(" ".join(f"{c:>18}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
