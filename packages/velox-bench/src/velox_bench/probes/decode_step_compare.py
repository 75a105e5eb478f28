"""One layer's decode step at a real model's attention shape, every method side by side.

B 1, 32 query / 8 KV heads, head_dim 128, budget 512 (every step evicts): the cache update plus
the attention over what it returns, everything evaluated, timed in alternating rounds in one
process; medians and ratios to mlx-lm's ``RotatingKVCache(512)`` + ``scaled_dot_product_attention``.
Velox caches attend through ``cache.attend`` (what the attention hook calls), so the attend-once
path runs where it applies. ``--no-log`` rows use ``trim_window=0`` (no undo log). ``full``
is mlx-lm's ``KVCache`` + SDPA, fed the same prompt: it grows a row a step, as SnapKV does
after its cut, so ``snapkv`` against ``full`` compares two stores of about the same rows.

    python -m velox_bench.probes.decode_step_compare [--rounds 7] [--steps 30]
        [--methods tova h2o ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache  # noqa: E402

from velox_mlx_lm import KVCacheConfig, KVCacheFactory  # noqa: E402

B, H_Q, H_KV, D, BUDGET = 1, 32, 8, 128, 512
SCALE = D**-0.5
METHODS = [
    "rotating",
    "tova",
    "tova (no log)",
    "tova_adapted",
    "h2o",
    "streaming_llm",
    "morphkv",
    "snapkv",
    "full",
]


def make(method: str) -> Any:
    if method == "rotating":
        return RotatingKVCache(max_size=BUDGET, keep=4)
    if method == "full":
        return KVCache()
    name = method.split()[0]
    policy = "tova" if name.startswith("tova") else name
    budget: dict[str, Any] = {f"{policy}_budget": BUDGET}
    config = KVCacheConfig(method=name, trim_window=0 if "no log" in method else 16, **budget)
    return KVCacheFactory.create(config)


def step(cache: Any, k: mx.array, v: mx.array, q: mx.array) -> float:
    """One decode step as a model layer runs it: the fetched keys/values go out of scope before
    the step is evaluated (mlx-lm's attention returns first), so nothing but the graph holds the
    slots the step writes and MLX can write them in place. Returns the seconds spent building
    the graph (before ``mx.eval``)."""
    start = time.perf_counter()
    keys, values = cache.update_and_fetch(k, v)
    if isinstance(cache, (RotatingKVCache, KVCache)):
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE)
        del keys, values
        arrays = [out, cache.keys, cache.values]
    else:
        del keys, values  # the attention hook ignores them and calls cache.attend
        out = cache.attend(q, SCALE, None, None)
        arrays = [out, *cache.layer.arrays()]  # the rows as held (no frozen state built)
    built = time.perf_counter() - start
    mx.eval(arrays)
    return built


def in_place_write_ms(hold: bool, writes: int = 300) -> float:
    """Median ms of writing one token row into a ``[B, H_kv, BUDGET + 1, D]`` buffer with
    ``put_along_axis`` (what a decode step does to its slots), evaluated; ``hold``: another
    reference keeps the old buffer alive during the write."""
    buffer = mx.random.normal((B, H_KV, BUDGET + 1, D))
    mx.eval(buffer)
    times = []
    for i in range(writes):
        row = mx.random.normal((B, H_KV, 1, D))
        slot = mx.full((B, H_KV, 1, D), i % (BUDGET + 1), dtype=mx.int32)
        mx.eval(row, slot)
        old = buffer if hold else None
        start = time.perf_counter()
        buffer = mx.put_along_axis(buffer, slot, row, axis=2)
        mx.eval(buffer)
        times.append(time.perf_counter() - start)
        del old
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS[1:], default=METHODS[1:], help="besides rotating"
    )
    args = parser.parse_args(argv)
    print(f"BLAS: {BLAS}; device: {mx.default_device()}")
    caches = {}
    for method in ["rotating", *args.methods]:
        cache = make(method)
        n = BUDGET + 8
        k, v = mx.random.normal((B, H_KV, n, D)), mx.random.normal((B, H_KV, n, D))
        q = mx.random.normal((B, H_Q, n, D))
        step(cache, k, v, q)
        if hasattr(cache, "finish_prefill"):
            cache.finish_prefill()
        caches[method] = cache
    times: dict[str, list[float]] = {m: [] for m in caches}
    builds: dict[str, list[float]] = {m: [] for m in caches}
    for _ in range(args.rounds):
        for method, cache in caches.items():
            inputs = [
                (
                    mx.random.normal((B, H_KV, 1, D)),
                    mx.random.normal((B, H_KV, 1, D)),
                    mx.random.normal((B, H_Q, 1, D)),
                )
                for _ in range(args.steps)
            ]
            mx.eval(inputs)
            start = time.perf_counter()
            for k, v, q in inputs:
                builds[method].append(step(cache, k, v, q))
            times[method].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["rotating"])
    print(f"{'method':16}{'median ms':>12}{'vs rotating':>14}{'build ms':>12}")
    for method, ts in times.items():
        median = statistics.median(ts)
        build = statistics.median(builds[method]) * 1e3
        print(f"{method:16}{median * 1e3:12.3f}{median / base:14.2f}{build:12.3f}")
    dropped, held = in_place_write_ms(hold=False), in_place_write_ms(hold=True)
    print(
        f"one token written into a [{B}, {H_KV}, {BUDGET + 1}, {D}] buffer: {dropped:.3f} ms "
        f"when only the graph holds the old buffer, {held:.3f} ms when it is held elsewhere"
    )


if __name__ == "__main__":
    main()
