"""Micro: one layer's decode update per method vs one SDPA call over the same number of keys.

Budgets 64/256/512/2048, heads (H_kv 8, H_q 32, D 128) and (H_kv 3, H_q 9, D 64: the embedded
model's). Each round appends one token in steady state and evaluates everything it produced.
Methods: ``velox_bench.variants.micro_methods()`` (TOVA's signal × scope grid, every other
registered policy method, mlx-lm's KVCache and RotatingKVCache, SDPA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from velox_bench.micro import make_subject
from velox_bench.results import SuiteResults, median_seconds, smoke
from velox_bench.variants import micro_methods

SMOKE = smoke()
# Every policy runs with its default settings, so the smoke budget must fit them all (SnapKV's
# observation window of 32 needs a budget above 32).
BUDGETS = [64] if SMOKE else [64, 256, 512, 2048]
SHAPES = [(2, 4, 16)] if SMOKE else [(8, 32, 128), (3, 9, 64)]
ROUNDS = 1 if SMOKE else 30


def _cases() -> list[Any]:
    return [
        pytest.param(budget, shape, method, id=f"budget{budget}-hkv{shape[0]}-{method}")
        for shape in SHAPES
        for budget in BUDGETS
        for method in micro_methods()
    ]


@pytest.mark.parametrize(("budget", "shape", "method"), _cases())
def test_micro(
    benchmark: Any,
    suite_results: Callable[[str], SuiteResults],
    budget: int,
    shape: tuple[int, int, int],
    method: str,
) -> None:
    h_kv, h_q, d = shape
    subject = make_subject(method, budget, h_kv, h_q, d)
    benchmark.pedantic(
        subject.step,
        setup=subject.reset,
        rounds=ROUNDS,
        warmup_rounds=0 if SMOKE else 3,
        iterations=1,
    )
    grows = ROUNDS + 5 if subject.grows else 1
    assert subject.n_keys() <= budget + grows
    seconds = median_seconds(benchmark)
    results = suite_results("micro")
    results.settings.update(budgets=BUDGETS, shapes=SHAPES, rounds=ROUNDS)
    if seconds is not None:
        results.add(
            config=f"budget{budget}-hkv{h_kv}-hq{h_q}-d{d}",
            budget=budget,
            h_kv=h_kv,
            h_q=h_q,
            d=d,
            method=method,
            seconds=seconds,
        )
