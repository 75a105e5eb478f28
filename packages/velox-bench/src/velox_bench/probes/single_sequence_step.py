"""One sequence's decode step on the embedded model: a Velox cache beside mlx-lm's full cache.

The prompt (random token ids) is fed once into each cache list, then both decode greedily in
alternating rounds of a few steps; the medians and the median of per-round ratios are printed.
With a prompt shorter than the budget nothing is evicted yet: what is left is the cost of the
Velox cache itself (its slots, engine call and undo log per layer), the baseline for
``velox-serve``'s short-context goal, where the batched path adds its per-row calls on top.

    python -m velox_bench.probes.single_sequence_step [--prompt 416] [--method tova] [--budget 512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=416, help="prompt tokens")
    add_run_arguments(parser)
    args = parser.parse_args()
    model = load_default()[0]
    prompt = mx.random.randint(0, 2000, (1, args.prompt), key=mx.random.key(0))
    policy = KVCacheConfig(method=args.method).policy
    config = KVCacheConfig(method=args.method, **{f"{policy}_budget": args.budget})
    lists: dict[str, Any] = {
        "full": make_prompt_cache(model),
        args.method: KVCacheBuilder.for_model(model, config),
    }
    state = {}
    for name, caches in lists.items():
        logits = model(prompt, cache=caches)
        mx.eval(logits, [c.state for c in caches])
        state[name] = mx.argmax(logits[:, -1:], axis=-1)
    times = alternate(model, lists, state, args.rounds, args.steps)
    print(f"BLAS: {BLAS}; prompt {args.prompt} tokens, {args.rounds} rounds x {args.steps} steps")
    report(times, args.method)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The method, budget and round options both step tools take."""
    parser.add_argument("--method", default="tova")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")


def alternate(
    model: Any, lists: dict[str, Any], state: dict[str, mx.array], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Greedy decode with every cache list in turn, ``steps`` steps per round, from the next
    tokens in ``state`` (updated): seconds per step, one entry per round and list."""
    times: dict[str, list[float]] = {name: [] for name in lists}
    for _ in range(rounds):
        for name, caches in lists.items():
            y = state[name]
            start = time.perf_counter()
            for _ in range(steps):
                y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
                mx.eval(y)
            times[name].append((time.perf_counter() - start) / steps)
            state[name] = y
    return times


def report(times: dict[str, list[float]], method: str) -> float:
    """Print each list's median step and ``method``'s median per-round ratio to ``full``."""
    for name, ts in times.items():
        print(f"{name:14}{statistics.median(ts) * 1e3:10.1f} ms/step")
    ratio = statistics.median(a / b for a, b in zip(times[method], times["full"], strict=True))
    print(f"{method} / full: {ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
