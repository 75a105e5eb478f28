"""Half-precision caches: rows stay in the model's dtype, scores are float32, so the decisions
equal those of a float32 state fed the same (half-precision) values."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import POLICIES

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tova", {"preset": "tova"}),
    ("tova", {"preset": "tova_adapted"}),
    ("tova", {"preset": "tova", "prefill": "oneshot", "scope": "head"}),
    ("h2o", {"scope": "layer"}),
    ("morphkv", {"window": 3}),
    ("snapkv", {"window": 3}),
]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=lambda x: str(x))
def test_same_decisions_as_float32_scoring(dtype: Any, name: str, options: dict[str, Any]) -> None:
    policy = POLICIES[name]
    sinks = {} if name == "snapkv" else {"n_sink": 1}
    rng = np.random.default_rng(0)
    k, v, q = (rng.standard_normal((2, 2, 60, 16)) * 2 for _ in range(3))
    q = np.concatenate([q, q[:, ::-1]], axis=1)  # 4 query heads over 2 KV heads
    half = [mx.array(x).astype(dtype) for x in (k, v, q)]
    full = [x.astype(mx.float32) for x in half]
    states = [policy.init(budget=12, **sinks, **options) for _ in range(2)]
    start = 0
    for size in (20, 1, 1, 7, 1, 1, 30):
        part = slice(start, start + size)
        for i, (key, value, query) in enumerate((half, full)):
            states[i] = policy.update(
                states[i], key[:, :, part], value[:, :, part], query[:, :, part]
            ).state
        if name == "snapkv" and size == 1:
            states = [policy.end_prompt(s) for s in states]
        start += size
    a, b = states
    assert a.slots.keys.dtype == dtype and b.slots.keys.dtype == mx.float32
    assert np.array_equal(np.array(a.positions), np.array(b.positions))
    assert mx.array_equal(a.keys.astype(mx.float32), b.keys)
