"""Prefill: TOVA (query signal, layer scope) over synthetic prompts of 512..8192 tokens.

Sweep: budget 64/256/1024, n_sink 0/4, prefill mode sequential and oneshot, chunks of 512
tokens, heads of the embedded model (H_kv 3, H_q 9, D 64). Compression ratio must be exactly
seq_len / budget; the log-log slope of time vs seq_len is reported (about 1 for a fixed
budget). Then one causal SDPA over 4096 tokens vs TOVA sequential prefill of those 4096
tokens into budget 512 (H_kv 8, H_q 32, D 128).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from velox_bench.prefill import CHUNK, random_prompt, tova_prefill
from velox_bench.results import SuiteResults, median_seconds, smoke

SMOKE = smoke()
SEQ_LENS = [64, 128] if SMOKE else [512, 1024, 2048, 4096, 8192]
BUDGETS = [16] if SMOKE else [64, 256, 1024]
SWEEP_SHAPE = (2, 4, 16) if SMOKE else (3, 9, 64)
SDPA_SHAPE = (2, 4, 16) if SMOKE else (8, 32, 128)
SDPA_LEN, SDPA_BUDGET = (128, 32) if SMOKE else (4096, 512)
CHUNK_SIZE = 32 if SMOKE else CHUNK
ROUNDS = 1 if SMOKE else 3


def _sweep_cases() -> list[Any]:
    return [
        pytest.param(mode, budget, n_sink, n, id=f"{mode}-budget{budget}-sink{n_sink}-len{n}")
        for mode in ("sequential", "oneshot")
        for budget in BUDGETS
        for n_sink in (0, 4)
        for n in SEQ_LENS
    ]


@pytest.fixture(scope="module")
def prompts() -> dict[int, tuple[mx.array, mx.array, mx.array]]:
    return {}


@pytest.mark.parametrize(("mode", "budget", "n_sink", "seq_len"), _sweep_cases())
def test_prefill_sweep(
    benchmark: Any,
    suite_results: Callable[[str], SuiteResults],
    prompts: dict[int, tuple[mx.array, mx.array, mx.array]],
    mode: str,
    budget: int,
    n_sink: int,
    seq_len: int,
) -> None:
    if seq_len not in prompts:
        prompts.clear()
        prompts[seq_len] = random_prompt(seq_len, *SWEEP_SHAPE)
    keys, values, queries = prompts[seq_len]
    state = benchmark.pedantic(
        tova_prefill,
        args=(keys, values, queries, budget, n_sink, mode, CHUNK_SIZE),
        rounds=ROUNDS,
        iterations=1,
    )
    expected = seq_len / min(seq_len, budget)
    assert state.compression_ratio == expected
    assert state.n_kept == min(seq_len, budget)
    seconds = median_seconds(benchmark)
    results = suite_results("prefill")
    results.settings.update(
        sweep_shape=SWEEP_SHAPE, chunk=CHUNK_SIZE, rounds=ROUNDS, signal="query", scope="layer"
    )
    if seconds is not None:
        results.add(
            kind="sweep",
            mode=mode,
            budget=budget,
            n_sink=n_sink,
            seq_len=seq_len,
            seconds=seconds,
            compression_ratio=state.compression_ratio,
        )


@pytest.mark.parametrize("method", ["causal_sdpa", "tova_sequential"])
def test_prefill_vs_sdpa(
    benchmark: Any, suite_results: Callable[[str], SuiteResults], method: str
) -> None:
    h_kv, h_q, d = SDPA_SHAPE
    keys, values, queries = random_prompt(SDPA_LEN, h_kv, h_q, d, seed=1)
    if method == "causal_sdpa":

        def run() -> None:
            out = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=d**-0.5, mask="causal"
            )
            mx.eval(out)

        benchmark.pedantic(run, rounds=ROUNDS, iterations=1)
    else:
        state = benchmark.pedantic(
            tova_prefill,
            args=(keys, values, queries, SDPA_BUDGET, 4, "sequential", CHUNK_SIZE),
            rounds=ROUNDS,
            iterations=1,
        )
        assert state.compression_ratio == SDPA_LEN / SDPA_BUDGET
    seconds = median_seconds(benchmark)
    if seconds is not None:
        suite_results("prefill").add(
            kind="vs_sdpa",
            method=method,
            seq_len=SDPA_LEN,
            budget=SDPA_BUDGET,
            shape=list(SDPA_SHAPE),
            seconds=seconds,
        )
