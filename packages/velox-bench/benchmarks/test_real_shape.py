"""Real attention shape: every method side by side on a random llama with Llama-3.2-1B's attention.

The model (built here, random weights, nothing downloaded): mlx-lm's llama with hidden 2048,
32 query / 8 KV heads, head_dim 64, MLP 8192, 2 layers, vocabulary 1024 (a small vocabulary
keeps the output projection from hiding the attention). Prompts are fed like
``mlx_lm.generate`` feeds them: chunks of 2048 (its default ``prefill_step_size``), the caches'
state evaluated after each chunk. Budget 512.

Per dtype (float32, bfloat16) and context (2k/4k/8k/16k), every row of
``velox_bench.variants.model_methods()`` (full ``KVCache``, ``RotatingKVCache(512, keep=4)``,
TOVA sequential and oneshot, ``tova_adapted``, H2O, StreamingLLM, SnapKV, MorphKV):

- prefill: the whole prompt, timed in interleaved rounds (every method once per round), median;
  the peak MLX memory a prefill adds on top of what was allocated before it;
- decode: after the prompt, ``DECODE_STEPS`` greedy steps per round, every method once per round,
  median seconds per step.

Ratios (time vs full and vs rotating; decode speed-up) come from the same interleaved run.
Results go to ``benchmarks/results/real_shape.json`` (rows, summary with the issue's targets)
and ``benchmarks/figures/real_shape.png``.

Environment: ``VELOX_BENCH_REAL_CONTEXTS`` (default ``2048,4096,8192,16384``, float32),
``VELOX_BENCH_REAL_BF16_CONTEXTS`` (default ``2048,4096``: bfloat16 matmuls are 8-35x slower
than float32 on the CPU backend), ``VELOX_BENCH_REAL_PREFILL_ROUNDS`` (default 3),
``VELOX_BENCH_REAL_DECODE_ROUNDS`` (default 7), ``VELOX_BENCH_REAL_METHODS`` (a comma-separated
subset of the methods; default all). ``VELOX_BENCH_SMOKE=1``: tiny model and sizes.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm  # type: ignore[import-untyped]

from velox_bench.models import (
    decode_step,
    grows_after_prompt_end,
    kv_bytes,
    make_caches,
    prefill,
    random_llama,
)
from velox_bench.results import SuiteResults, smoke
from velox_bench.summary import real_shape_table
from velox_bench.variants import model_methods

SMOKE = smoke()
SHAPE = (
    dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)
    if SMOKE
    else dict(layers=2, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=1024)
)
BUDGET = 64 if SMOKE else 512
CHUNK = 32 if SMOKE else 2048  # mlx_lm.generate's default prefill_step_size


def _ints(name: str, default: str) -> list[int]:
    return [int(c) for c in os.environ.get(name, default).split(",") if c]


CONTEXTS = {
    "float32": _ints("VELOX_BENCH_REAL_CONTEXTS", "96,160" if SMOKE else "2048,4096,8192,16384"),
    "bfloat16": _ints("VELOX_BENCH_REAL_BF16_CONTEXTS", "96" if SMOKE else "2048,4096"),
}
PREFILL_ROUNDS = 1 if SMOKE else int(os.environ.get("VELOX_BENCH_REAL_PREFILL_ROUNDS", "3"))
DECODE_ROUNDS = 2 if SMOKE else int(os.environ.get("VELOX_BENCH_REAL_DECODE_ROUNDS", "7"))
DECODE_STEPS = 2 if SMOKE else 16  # per round and method


def _prefill_rounds(
    model: nn.Module, tokens: mx.array, methods: list[str], bar: Any
) -> tuple[dict[str, list[float]], dict[str, int], dict[str, tuple[list[Any], mx.array]]]:
    """Every method's prefill once per round; the last round's caches are kept for decode."""
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, int] = {}
    ready: dict[str, tuple[list[Any], mx.array]] = {}
    for _ in range(PREFILL_ROUNDS):
        for method in methods:
            ready.pop(method, None)
            caches = make_caches(model, method, BUDGET)
            mx.clear_cache()
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            start = time.perf_counter()
            y = prefill(model, caches, tokens, CHUNK)
            seconds[method].append(time.perf_counter() - start)
            peaks[method] = max(peaks.get(method, 0), mx.get_peak_memory() - before)
            ready[method] = (caches, y)
            bar.update(1)
    return seconds, peaks, ready


def _decode_rounds(
    model: nn.Module, ready: dict[str, tuple[list[Any], mx.array]], bar: Any
) -> dict[str, list[float]]:
    """``DECODE_STEPS`` greedy steps per method per round, seconds per step."""
    current = {m: decode_step(model, caches, y) for m, (caches, y) in ready.items()}  # warm-up
    seconds: dict[str, list[float]] = {m: [] for m in ready}
    for _ in range(DECODE_ROUNDS):
        for method, (caches, _) in ready.items():
            y = current[method]
            start = time.perf_counter()
            for _ in range(DECODE_STEPS):
                y = decode_step(model, caches, y)
            seconds[method].append((time.perf_counter() - start) / DECODE_STEPS)
            current[method] = y
            bar.update(1)
    return seconds


def test_real_shape(suite_results: Callable[[str], SuiteResults]) -> None:
    results = suite_results("real_shape")
    methods = model_methods()
    chosen = [m for m in os.environ.get("VELOX_BENCH_REAL_METHODS", "").split(",") if m]
    if chosen:
        unknown = sorted(set(chosen) - set(methods))
        if unknown:
            raise ValueError(f"VELOX_BENCH_REAL_METHODS: unknown {unknown}; known: {methods}")
        methods = [m for m in methods if m in chosen]
    results.settings.update(
        model="random llama (mlx-lm llama, Llama-3.2-1B attention)",
        shape={**SHAPE, "head_dim": SHAPE["hidden"] // SHAPE["heads"]},
        budget=BUDGET,
        prefill_chunk=CHUNK,
        contexts=CONTEXTS,
        prefill_rounds=PREFILL_ROUNDS,
        decode_rounds=DECODE_ROUNDS,
        decode_steps_per_round=DECODE_STEPS,
        methods=methods,
    )
    work = sum(len(c) for c in CONTEXTS.values()) * len(methods)
    bar = tqdm(total=work * (PREFILL_ROUNDS + DECODE_ROUNDS), desc="real shape", disable=SMOKE)
    for dtype_name, contexts in CONTEXTS.items():
        if not contexts:
            continue
        model = random_llama(**SHAPE, dtype=getattr(mx, dtype_name))  # type: ignore[arg-type]
        for ctx in contexts:
            bar.set_postfix_str(f"{dtype_name} {ctx}")
            tokens = mx.random.randint(0, SHAPE["vocab"], (1, ctx), key=mx.random.key(ctx))
            prefill_s, peaks, ready = _prefill_rounds(model, tokens, methods, bar)
            decode_s = _decode_rounds(model, ready, bar)
            for method in methods:
                caches = ready[method][0]
                common = dict(dtype=dtype_name, context=ctx, method=method)
                p, d = statistics.median(prefill_s[method]), statistics.median(decode_s[method])
                results.add(
                    **common,
                    phase="prefill",
                    seconds=p,
                    rounds=prefill_s[method],
                    tokens_per_s=ctx / p,
                    peak_memory_bytes=peaks[method],
                )
                results.add(
                    **common,
                    phase="decode",
                    seconds=d,
                    rounds=decode_s[method],
                    tokens_per_s=1.0 / d,
                    kv_bytes=kv_bytes(caches),
                    kept_per_layer=int(caches[0].size()),
                )
                if method != "full":  # SnapKV grows after its cut
                    grows = DECODE_STEPS * DECODE_ROUNDS + 1
                    assert caches[0].size() <= BUDGET + (
                        grows if grows_after_prompt_end(method) else 0
                    )
            del ready
            mx.clear_cache()
    bar.close()
    print()
    print(real_shape_table(results.rows))
