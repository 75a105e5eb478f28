"""Model-level speed: the embedded SmolLM2-135M at 1k/4k/8k tokens of real text.

Per (context, method): one timed prefill (chunks of 512 tokens), then 32 timed greedy decode
steps (median), peak memory and KV bytes. Full ``KVCache``, ``RotatingKVCache(512, keep=4)`` and
every registered Velox method (plus ``tova_oneshot``) at budget 512: the rows of
``velox_bench.variants.model_methods()``. ``VELOX_BENCH_MODEL_REDUCED`` (default ``8192``) lists
the contexts that run only full, rotating and the TOVA variants, to keep ``nox -s bench`` under
an hour on a 2-core machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from velox_bench.models import (
    BUDGET,
    PREFILL_STEP,
    decode_step,
    grows_after_prompt_end,
    kv_bytes,
    make_caches,
    prefill,
    sotu_tokens,
    tiny_llama,
)
from velox_bench.results import SuiteResults, median_seconds, smoke
from velox_bench.variants import FULL, model_methods, reduced_model_methods

SMOKE = smoke()
CONTEXTS = [96, 160] if SMOKE else [1024, 4096, 8192]
DECODE_STEPS = 2 if SMOKE else 32
REDUCED_METHODS = reduced_model_methods()
_REDUCED_DEFAULT = "160" if SMOKE else "8192"
REDUCED = {
    int(c) for c in os.environ.get("VELOX_BENCH_MODEL_REDUCED", _REDUCED_DEFAULT).split(",") if c
}


def _cases() -> list[Any]:
    cases = []
    for ctx in CONTEXTS:
        for method in REDUCED_METHODS if ctx in REDUCED else model_methods():
            for phase in ("prefill", "decode"):
                cases.append(pytest.param(ctx, method, phase, id=f"{ctx}-{method}-{phase}"))
    return cases


@pytest.fixture(scope="module")
def model_and_tokens() -> tuple[nn.Module, mx.array, str]:
    if SMOKE:
        model = tiny_llama()
        return model, mx.random.randint(0, 256, (1, max(CONTEXTS))), "tiny random llama"
    try:
        from velox_mlx_lm.embedded import ModelNotFoundError, load_default
    except ImportError as exc:  # pragma: no cover
        pytest.skip(str(exc))
    try:
        model, tokenizer = load_default()
        tokens = sotu_tokens(tokenizer, max(CONTEXTS))
    except (ModelNotFoundError, ModuleNotFoundError) as exc:
        pytest.skip(str(exc))
    from velox_mlx_lm import install_attention_hook

    install_attention_hook(model)  # every method, baselines included, runs through the hook
    return model, mx.array(tokens)[None], "SmolLM2-135M-Instruct (float32, dequantized Q4_1)"


# (context, method) -> (caches, next token, peak bytes during prefill): prefill hands to decode
_PREFILLED: dict[tuple[int, str], tuple[list[Any], mx.array, int]] = {}


@pytest.mark.parametrize(("ctx", "method", "phase"), _cases())
def test_model(
    benchmark: Any,
    suite_results: Callable[[str], SuiteResults],
    model_and_tokens: tuple[nn.Module, mx.array, str],
    ctx: int,
    method: str,
    phase: str,
) -> None:
    model, tokens, model_name = model_and_tokens
    results = suite_results("model")
    results.settings.update(
        model=model_name,
        budget=BUDGET,
        prefill_step=PREFILL_STEP,
        decode_steps=DECODE_STEPS,
        contexts=CONTEXTS,
        reduced_contexts=sorted(REDUCED),
        reduced_methods=REDUCED_METHODS,
    )
    prompt = tokens[:, :ctx]
    if phase == "prefill":
        made: list[list[Any]] = []

        def setup() -> None:
            _PREFILLED.pop((ctx, method), None)
            made.append(make_caches(model, method))
            mx.reset_peak_memory()

        def run() -> mx.array:
            return prefill(model, made[-1], prompt)

        y = benchmark.pedantic(run, setup=setup, rounds=1, iterations=1)
        peak = mx.get_peak_memory()
        _PREFILLED[(ctx, method)] = (made[-1], y, peak)
        caches = made[-1]
        seconds = median_seconds(benchmark)
        if seconds is not None:
            results.add(
                phase="prefill",
                context=ctx,
                method=method,
                seconds=seconds,
                tokens_per_s=ctx / seconds,
                kv_bytes=kv_bytes(caches),
                peak_memory_bytes=peak,
                kept_per_layer=int(caches[0].size()),
            )
        return

    if (ctx, method) in _PREFILLED:
        caches, y, peak_prefill = _PREFILLED.pop((ctx, method))
    else:  # decode selected alone: prefill untimed
        caches = make_caches(model, method)
        mx.reset_peak_memory()
        y = prefill(model, caches, prompt)
        peak_prefill = mx.get_peak_memory()
    mx.reset_peak_memory()
    current = [y]

    def step() -> None:
        current[0] = decode_step(model, caches, current[0])

    step()  # warm-up (SnapKV's first step after the prompt, allocations)
    benchmark.pedantic(step, rounds=DECODE_STEPS, iterations=1)
    seconds = median_seconds(benchmark)
    if seconds is not None:
        results.add(
            phase="decode",
            context=ctx,
            method=method,
            seconds=seconds,
            tokens_per_s=1.0 / seconds,
            kv_bytes=kv_bytes(caches),
            peak_memory_bytes=max(peak_prefill, mx.get_peak_memory()),
            kept_per_layer=int(caches[0].size()),
        )
    if method != FULL:  # SnapKV grows after the prompt cut
        grows = DECODE_STEPS + 2 if grows_after_prompt_end(method) else 0
        assert caches[0].size() <= BUDGET + grows
