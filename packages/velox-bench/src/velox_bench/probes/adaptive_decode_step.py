"""One layer's decode step after an adaptive cut (lanes) against the uniform cut, side by side.

B 1, 32 query / 8 KV heads, head_dim 128: a 2,048-token prompt cut to ``budget`` rows per KV
head, ``allocation="uniform"`` (one ordinary store) or ``"head"`` (AdaKV's shares held as lanes,
:mod:`velox_cache_core.lanes`), by SnapKV (which appends afterwards), TOVA, H2O (scope
``head``) and Expected Attention (they evict within each head's share at every step); then
decode steps (update plus attention through ``cache.attend``, what the hook calls),
everything evaluated, timed in alternating rounds in one process. Prints medians and the
ratio ``head / uniform`` per method (issue 34: at most 1.2).

    python -m velox_bench.probes.adaptive_decode_step [--budget 512] [--rounds 7] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402

from velox_mlx_lm import KVCacheConfig, KVCacheFactory  # noqa: E402

B, H_Q, H_KV, D, PROMPT = 1, 32, 8, 128, 2048
SCALE = D**-0.5
MODES = ("uniform", "head")
METHODS = ("snapkv", "tova", "h2o", "expected_attention")


def cut_cache(method: str, mode: str, budget: int) -> Any:
    """A ``method`` cache after a ``PROMPT``-token prompt, cut with ``mode``; per-head key
    scales differ so that AdaKV's shares do."""
    settings: dict[str, Any] = {f"{method}_budget": budget, f"{method}_allocation": mode}
    if method == "tova":
        settings["tova_scope"] = "head"
    if method == "expected_attention":  # no model to read its RoPE off
        settings["expected_attention_rope_base"] = 10000.0
    cache = KVCacheFactory.create(KVCacheConfig(method=method, **settings))
    spread = mx.linspace(0.5, 2.0, H_KV).reshape(1, H_KV, 1, 1)
    k = mx.random.normal((B, H_KV, PROMPT, D), key=mx.random.key(0)) * spread
    v = mx.random.normal((B, H_KV, PROMPT, D), key=mx.random.key(1))
    q = mx.random.normal((B, H_Q, PROMPT, D), key=mx.random.key(2))
    cache.update_and_fetch(k, v)
    mx.eval(cache.attend(q, SCALE, None, None))
    cache.layer.end_prompt()
    step(cache, k[:, :, :1], v[:, :, :1], q[:, :, :1])  # the first token (TOVA/H2O cut here)
    assert (cache.layer.state.lanes is not None) == (mode != "uniform")
    return cache


def step(cache: Any, k: mx.array, v: mx.array, q: mx.array) -> None:
    keys, values = cache.update_and_fetch(k, v)
    del keys, values  # the attention hook ignores them and calls cache.attend
    out = cache.attend(q, SCALE, None, None)
    state = cache.policy_state
    mx.eval(out, *state.slots.arrays(), *([] if state.lanes is None else state.lanes.arrays()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(f"BLAS: {BLAS}; device: {mx.default_device()}")
    caches = {(m, mode): cut_cache(m, mode, args.budget) for m in METHODS for mode in MODES}
    for m in METHODS:
        lanes = caches[m, "head"].layer.state.lanes
        counts = lanes.counts(H_KV).tolist()[0]
        print(f"{m} head: {lanes.n_lanes} lanes of {lanes.width} rows; rows per head {counts}")
    times: dict[tuple[str, str], list[float]] = {key: [] for key in caches}
    for _ in range(args.rounds):
        for key, cache in caches.items():
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
                step(cache, k, v, q)
            times[key].append((time.perf_counter() - start) / args.steps)
    print(f"{'method':10}{'uniform ms':>12}{'head ms':>12}{'head / uniform':>16}")
    for m in METHODS:
        uniform = statistics.median(times[m, "uniform"])
        head = statistics.median(times[m, "head"])
        print(f"{m:10}{uniform * 1e3:12.3f}{head * 1e3:12.3f}{head / uniform:16.2f}")


if __name__ == "__main__":
    main()
