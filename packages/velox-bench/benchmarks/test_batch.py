"""Batched decode (issue 13): TOVA(512) in mlx-lm's batch path next to one sequence and to
mlx-lm's own ``BatchKVCache``, on the embedded model and on a random llama of real shape.

Models: the embedded SmolLM2-135M-Instruct (float32, dequantized; 9 query / 3 KV heads,
head_dim 64, 30 layers; prompt: State of the Union text) and a random mlx-lm llama with
Llama-3.2-1B's attention (32 query / 8 KV heads, head_dim 64, hidden 2048, MLP 8192, 2 layers,
vocabulary 1024; random tokens), the real-shape suite's model. OpenBLAS when present.

Per model and context per row (default 512, 4096, 8192), in interleaved rounds: TOVA and the
full cache, one sequence and a batch of 4 (``velox_bench.batch_bench`` says how the caches are
made and how decode is driven). Reports aggregate decode tokens/s, the batch-of-4 speed-up,
TOVA vs full, the per-row eviction overhead at context = budget, and peak memory, with the
issue's goals; writes ``benchmarks/results/batch.json`` and ``benchmarks/figures/batch.png``.

Environment: ``VELOX_BENCH_BATCH_MODELS`` (default ``embedded,real_shape``),
``VELOX_BENCH_BATCH_CONTEXTS`` (default ``512,4096,8192``), ``VELOX_BENCH_BATCH_ROUNDS``
(default 5), ``VELOX_BENCH_BATCH_STEPS`` (timed steps per round, default 8).
``VELOX_BENCH_SMOKE=1``: a tiny random llama, budget 16, tiny contexts.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from tqdm import tqdm  # type: ignore[import-untyped]

from velox_bench.batch_bench import (
    BATCH,
    FULL,
    TOVA,
    Variant,
    batch_summary,
    batch_table,
    chunk_bounds,
    measure_context,
    plot_batch,
    random_full_cache,
    rows_for,
    snapshots,
    variants,
)
from velox_bench.models import random_llama, sotu_tokens
from velox_bench.results import SuiteResults, blas_report, figures_dirs, smoke

SMOKE = smoke()
REAL_SHAPE = dict(layers=2, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=1024)
TINY_SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)
BUDGET = 16 if SMOKE else 512
CHUNK = 32 if SMOKE else 2048  # mlx-lm's default prefill_step_size
CONTEXTS = [
    int(c)
    for c in (
        "16,48,80" if SMOKE else os.environ.get("VELOX_BENCH_BATCH_CONTEXTS", "512,4096,8192")
    ).split(",")
    if c
]
ROUNDS = 2 if SMOKE else int(os.environ.get("VELOX_BENCH_BATCH_ROUNDS", "5"))
STEPS = 2 if SMOKE else int(os.environ.get("VELOX_BENCH_BATCH_STEPS", "8"))
MODELS = (
    ["tiny"]
    if SMOKE
    else os.environ.get("VELOX_BENCH_BATCH_MODELS", "embedded,real_shape").split(",")
)


def _model(name: str) -> tuple[nn.Module, mx.array, str]:
    """(model with the attention hook, prompt tokens [1, max context], description)."""
    n = max(CONTEXTS)
    if name == "embedded":
        from velox_mlx_lm import install_attention_hook
        from velox_mlx_lm.embedded import load_default

        model, tokenizer = load_default()
        install_attention_hook(model)
        try:
            tokens = mx.array(sotu_tokens(tokenizer, n))[None]
            text = "State of the Union text"
        except ModuleNotFoundError:
            tokens = mx.random.randint(0, model.args.vocab_size, (1, n), key=mx.random.key(0))
            text = "random tokens (sotu not installed)"
        return model, tokens, f"SmolLM2-135M-Instruct (float32, dequantized), {text}"
    shape = TINY_SHAPE if name == "tiny" else REAL_SHAPE if name == "real_shape" else None
    if shape is None:
        raise ValueError(f"unknown model {name!r}: embedded, real_shape")
    model = random_llama(**shape)  # type: ignore[arg-type]
    tokens = mx.random.randint(0, shape["vocab"], (1, n), key=mx.random.key(0))
    return model, tokens, f"random llama {shape}, random tokens"


def _check_budget(v: Variant, caches: list[Any]) -> None:
    """Every TOVA row stays within its budget (correctness, not timing)."""
    if v.method == TOVA:
        for c in caches:
            kept = c.tokens_kept
            assert max(kept if isinstance(kept, list) else [kept]) <= BUDGET


def test_batch() -> None:
    results = SuiteResults("batch")
    results.settings.update(
        budget=BUDGET,
        batch=BATCH,
        prefill_chunk=CHUNK,
        contexts=CONTEXTS,
        rounds=ROUNDS,
        steps_per_round=STEPS,
        variants=[v.name for v in variants()],
        driver=(
            "model called on [B, 1] tokens with merged caches (type(c).merge of single-sequence "
            "caches, as BatchGenerator merges), mx.eval of the next tokens only; one warm-up "
            "step per round; the B rows hold the same prompt"
        ),
        full_cache="mlx-lm KVCache / BatchKVCache holding random keys and values",
        models={},
    )
    chunks = len(chunk_bounds(CONTEXTS, CHUNK))
    bar = tqdm(
        total=len(MODELS) * (chunks + len(CONTEXTS) * ROUNDS * len(variants())),
        desc="batch",
        disable=SMOKE,
    )
    for name in MODELS:
        try:
            model, tokens, description = _model(name)
        except (ImportError, FileNotFoundError) as exc:  # the embedded model is optional
            pytest.skip(f"{name}: {exc}")
        results.settings["models"][name] = description
        bar.set_postfix_str(f"{name} prefill")
        tova = snapshots(model, tokens, CONTEXTS, BUDGET, CHUNK, on_chunk=lambda _: bar.update(1))
        for ctx in CONTEXTS:
            bar.set_postfix_str(f"{name} {ctx}")
            tova_caches, y = tova.pop(ctx)  # the full cache starts from TOVA's next token
            pristine = {TOVA: (tova_caches, y), FULL: (random_full_cache(model, ctx), y)}
            measured = measure_context(
                model,
                pristine,
                ROUNDS,
                STEPS,
                on_round=lambda: bar.update(1),
                check=_check_budget,
            )
            for row in rows_for(name, ctx, measured):
                results.add(**row)
            del pristine, tova_caches
            mx.clear_cache()
        del model, tova
        mx.clear_cache()
    bar.close()
    results.summary = batch_summary(results.rows, BUDGET)
    path = results.write(blas_report())
    figures = plot_batch(
        {"rows": results.rows, "settings": results.settings},
        [d / "batch.png" for d in figures_dirs()],
    )
    print()
    print(batch_table(results.rows, results.summary))
    print(f"velox-bench: wrote {path}, {', '.join(str(f) for f in figures)}")
