"""Soak: 32k greedy decode steps with TOVA(512) on a tiny random mlx-lm llama.

KV bytes must stay flat once the budget is reached and active memory must not grow (no graph
growth); per-step time of the first and last thousand steps is reported, not asserted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from velox_bench.models import decode_step, kv_bytes, tiny_llama
from velox_bench.results import SuiteResults, median_seconds, smoke
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

SMOKE = smoke()
STEPS = 384 if SMOKE else 32_768
BUDGET = 32 if SMOKE else 512
WINDOW = 64 if SMOKE else 1000  # steps compared at the start and the end
SAMPLE_EVERY = 32 if SMOKE else 1024
MEMORY_SLACK = 1 << 20  # bytes of active-memory drift tolerated


def test_soak_tova_decode(benchmark: Any, suite_results: Callable[[str], SuiteResults]) -> None:
    model = tiny_llama(layers=2, hidden=64)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("tova", tova_budget=BUDGET))
    step_times: list[float] = []
    samples: list[dict[str, int]] = []

    def soak() -> None:
        y = mx.array([[1]])
        for i in range(STEPS):
            start = time.perf_counter()
            y = decode_step(model, caches, y)
            step_times.append(time.perf_counter() - start)
            if (i + 1) % SAMPLE_EVERY == 0:
                samples.append(
                    {
                        "step": i + 1,
                        "kv_bytes": kv_bytes(caches),
                        "active_memory": mx.get_active_memory(),
                        "kept": int(caches[0].size()),
                    }
                )

    benchmark.pedantic(soak, rounds=1, iterations=1)
    full = [s for s in samples if s["step"] > BUDGET + 1]
    assert full, "the soak never reached the budget"
    assert {s["kv_bytes"] for s in full} == {full[0]["kv_bytes"]}, "KV bytes grew"
    assert all(s["kept"] == BUDGET for s in full)
    drift = max(s["active_memory"] for s in full) - full[0]["active_memory"]
    assert drift <= MEMORY_SLACK + full[0]["active_memory"] // 20, f"active memory grew {drift} B"
    first = statistics.median(step_times[:WINDOW])
    last = statistics.median(step_times[-WINDOW:])
    if median_seconds(benchmark) is not None:
        results = suite_results("soak")
        results.settings.update(
            model="tiny random llama (2 layers, hidden 64, 4 q heads, 2 kv heads)",
            steps=STEPS,
            budget=BUDGET,
            window=WINDOW,
        )
        results.rows.extend({"kind": "sample", **s} for s in samples)
        results.add(
            kind="summary",
            steps=STEPS,
            total_seconds=sum(step_times),
            median_step_first_window_s=first,
            median_step_last_window_s=last,
            last_over_first=last / first,
            kv_bytes_flat=full[0]["kv_bytes"],
            active_memory_drift_bytes=drift,
        )
