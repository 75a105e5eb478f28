"""The arithmetic of a TOVA decode step, without the cache around it, next to one SDPA call.

At a real model's attention (B 1, 32 query / 8 KV heads, head_dim 128, 513 candidates, the
``budget + 1`` of a decode step at budget 512), three ops are timed in alternating rounds, each
evaluated on its own already-evaluated inputs:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` (what ``RotatingKVCache`` runs);
- ``tova core``: what the attend-once path computes with the repo's own functions: the query's
  logits over the candidates (``grouped_logits``), their softmax, the layer mean
  (``head_mean``), the lowest weight outside the sinks (``lowest_weight``), and the attention
  output as weights times values (``velox_cache_core.attention.attend``'s CPU path);
- ``tova core, compiled``: the same function through ``mx.compile``;
- ``adapted core``: what ``tova_adapted`` (the new key as the probe, one decision per KV
  head) cannot share with the attention: the attention itself (one SDPA call, the cheapest
  form of it) plus the key's logits over the candidates per KV head, their softmax and each
  head's lowest weight outside the sinks; and the same through ``mx.compile``. Its ratio to
  ``sdpa`` is the floor under ``tova_adapted``'s one-layer step, whatever the cache does.

The medians and the median per-round ratios to ``sdpa`` show how far the decode-step target
(the whole step at most 1.15x Rotating's) is from what the arithmetic alone costs.

    python -m velox_bench.probes.attend_once_core [--rounds 9] [--reps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402

from velox_cache_core.distributed import head_mean  # noqa: E402
from velox_cache_core.scoring import grouped_logits, softmax  # noqa: E402
from velox_cache_core.selection import lowest_weight, sinks  # noqa: E402

B, H_Q, H_KV, D, N, N_SINK = 1, 32, 8, 128, 513, 4
SCALE = D**-0.5


def sdpa(q: mx.array, k: mx.array, v: mx.array, p: mx.array) -> tuple[mx.array, ...]:
    return (mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE),)


def tova_core(q: mx.array, k: mx.array, v: mx.array, p: mx.array) -> tuple[mx.array, ...]:
    weights = softmax(grouped_logits(q, k, SCALE, "layer"))  # [B, 1, H_q, 1, N]
    victim = lowest_weight(head_mean(weights, 2, None)[:, :, 0], p, sinks(p, N_SINK))
    probs = weights.reshape(B, H_KV, -1, 1, N)
    out = (probs @ v[:, :, None]).reshape(B, H_Q, 1, D)
    return out, victim


def adapted_core(q: mx.array, k: mx.array, v: mx.array, p: mx.array) -> tuple[mx.array, ...]:
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE)
    weights = softmax(grouped_logits(k[:, :, -1:], k, SCALE, "head"))  # [B, H_kv, 1, 1, N]
    victim = lowest_weight(weights[:, :, 0, 0], p, sinks(p, N_SINK))  # [B, H_kv]
    return out, victim


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=100, help="evaluations per op and round")
    args = parser.parse_args(argv)
    keys, values = mx.random.normal((B, H_KV, N, D)), mx.random.normal((B, H_KV, N, D))
    positions = mx.broadcast_to(mx.arange(N, dtype=mx.int32), (B, 1, N))
    queries = [mx.random.normal((B, H_Q, 1, D)) for _ in range(args.reps)]
    mx.eval(keys, values, positions, queries)
    ops: dict[str, Callable[..., tuple[mx.array, ...]]] = {
        "sdpa": sdpa,
        "tova core": tova_core,
        "tova core, compiled": mx.compile(tova_core),
        "adapted core": adapted_core,
        "adapted core, compiled": mx.compile(adapted_core),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, op in ops.items():
            runs = []
            for q in queries:
                start = time.perf_counter()
                mx.eval(op(q, keys, values, positions))
                runs.append(time.perf_counter() - start)
            times[name].append(statistics.median(runs))
    print(f"BLAS: {BLAS}; {args.rounds} rounds x {args.reps} evaluations")
    print(f"{'op':22}{'median ms':>12}{'vs sdpa':>10}")
    for name, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times["sdpa"], strict=True))
        print(f"{name:22}{statistics.median(ts) * 1e3:12.3f}{ratio:10.2f}")


if __name__ == "__main__":
    main()
