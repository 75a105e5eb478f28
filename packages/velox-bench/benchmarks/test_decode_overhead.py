"""Model-level decode overhead of TOVA against mlx-lm's KVCache, side by side in one process.

A random llama of real shape (12 layers, hidden 768, 12 query heads, 4 KV heads, head_dim 64):
- TOVA(512) decode step with 512 retained rows vs plain ``KVCache`` holding 512 tokens
  (target: <= 1.15x);
- both after an 8k-token prompt (target: TOVA faster than the full cache);
- 2,000 TOVA decode steps: per-step time around step 100 vs step 2,000, retained rows, KV bytes
  and MLX active memory (a lazy graph that grew would show in all of them).
Writes ``benchmarks/results/decode_overhead.json``. ``VELOX_BENCH_SMOKE=1`` shrinks everything.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from velox_bench.results import blas_report, machine_info, smoke, write_json
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

SMOKE = smoke()
SHAPE = (
    dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if SMOKE
    else dict(
        hidden_size=768,
        num_hidden_layers=12,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
    )
)
BUDGET = 16 if SMOKE else 512
LONG = 64 if SMOKE else 8192
STEPS = 4 if SMOKE else 24
SOAK = 40 if SMOKE else 2000
CHUNK = 32 if SMOKE else 512


def _model() -> llama.Model:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", rms_norm_eps=1e-5, vocab_size=1024, rope_theta=10000.0, **SHAPE
    )  # type: ignore[arg-type]
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _prefill(model: llama.Model, caches: list[Any], n: int) -> None:
    tokens = mx.random.randint(0, 1024, (1, n))
    for start in range(0, n, CHUNK):
        model(tokens[:, start : start + CHUNK], cache=caches)
        mx.eval([c.state for c in caches])


def _step_times(model: llama.Model, caches: list[Any], steps: int) -> list[float]:
    y = mx.array([[1]])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(y, [c.state for c in caches])  # the step's cache state is part of the step
        times.append(time.perf_counter() - start)
    return times


def _tova(model: llama.Model, prefill: str = "sequential") -> list[Any]:
    config = KVCacheConfig(method="tova", tova_budget=BUDGET, tova_prefill=prefill)
    return KVCacheBuilder.for_model(model, config)


def test_decode_overhead() -> None:
    model = _model()
    n_layers = len(model.layers)
    rows: dict[str, Any] = {}

    # At the budget: KVCache holding BUDGET tokens vs TOVA holding BUDGET (+1 slot) rows.
    full = [KVCache() for _ in range(n_layers)]
    _prefill(model, full, BUDGET)
    tova = _tova(model)
    _prefill(model, tova, BUDGET + CHUNK // 2)
    t_full = statistics.median(_step_times(model, full, STEPS))
    t_tova = statistics.median(_step_times(model, tova, STEPS))
    rows["at_budget"] = {
        "kvcache_ms": t_full * 1e3,
        "tova_ms": t_tova * 1e3,
        "tova_over_kvcache": t_tova / t_full,
        "target": "<= 1.15",
    }

    # After a long prompt. TOVA's prompt is cut in one shot here (same retained size as
    # sequential, much faster to set up); the decode step is what is measured.
    full = [KVCache() for _ in range(n_layers)]
    _prefill(model, full, LONG)
    tova = _tova(model, prefill="oneshot")
    _prefill(model, tova, LONG)
    t_full = statistics.median(_step_times(model, full, STEPS))
    t_tova = statistics.median(_step_times(model, tova, STEPS))
    rows["after_long_prompt"] = {
        "context": LONG,
        "kvcache_ms": t_full * 1e3,
        "tova_ms": t_tova * 1e3,
        "tova_speedup": t_full / t_tova,
        "target": "> 1 (TOVA faster)",
    }

    # Soak: a lazily growing graph or leaked side state would slow steps and grow memory.
    tova = _tova(model)
    _prefill(model, tova, BUDGET + 8)
    window = max(2, min(50, SOAK // 10))
    times: list[float] = []
    memory: dict[int, int] = {}
    kept: set[int] = set()
    nbytes: set[int] = set()
    y = mx.array([[1]])
    for step in range(1, SOAK + 1):
        start = time.perf_counter()
        logits = model(y, cache=tova)
        y = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(y, [c.state for c in tova])
        times.append(time.perf_counter() - start)
        kept.add(max(c.size() for c in tova))
        nbytes.add(sum(c.nbytes for c in tova))
        if step in (min(100, SOAK // 2), SOAK):
            memory[step] = mx.get_active_memory()
    early = statistics.median(times[min(100, SOAK // 2) - window // 2 :][:window])
    late = statistics.median(times[-window:])
    rows["soak"] = {
        "steps": SOAK,
        "step_ms_near_100": early * 1e3,
        "step_ms_last": late * 1e3,
        "late_over_early": late / early,
        "active_memory_bytes": {str(k): v for k, v in memory.items()},
        "retained_rows": sorted(kept),
        "kv_bytes": sorted(nbytes),
    }
    assert kept == {BUDGET}, kept
    assert len(nbytes) == 1, nbytes
    first, last = memory[min(100, SOAK // 2)], memory[SOAK]
    assert last <= first + 4 * 2**20, (first, last)

    out = {
        "suite": "decode_overhead",
        "machine": machine_info(),
        "blas": blas_report(),
        "model": {**SHAPE, "head_dim": SHAPE["hidden_size"] // SHAPE["num_attention_heads"]},
        "budget": BUDGET,
        "smoke": SMOKE,
        "results": rows,
    }
    write_json("decode_overhead", out)
    print(json.dumps(rows, indent=2))
