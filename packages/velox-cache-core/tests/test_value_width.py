"""Values of another width than keys (latent attention caches a latent and a RoPE part): every
policy keeps, attends and trims exactly as with values padded to the keys' width."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core.layer import Layer
from velox_cache_core.registry import POLICIES
from velox_cache_core.undo import new_log
from velox_cache_core.validation import check_kv

D, D_V, H_KV, H_Q = 8, 5, 2, 4
SETTINGS = {"morphkv": {"window": 2}, "h2o": {"n_sink": 1, "recent": 2}}


def _run(name: str, values_width: int) -> tuple[list[np.ndarray], Layer]:
    rng = np.random.default_rng(0)
    n = 16
    keys = mx.array(rng.normal(size=(1, H_KV, n, D)).astype(np.float32)) * 2
    values = mx.array(rng.normal(size=(1, H_KV, n, D_V)).astype(np.float32))
    if values_width > D_V:
        values = mx.concatenate([values, mx.zeros((1, H_KV, n, values_width - D_V))], axis=-1)
    queries = mx.array(rng.normal(size=(1, H_Q, n, D)).astype(np.float32)) * 2
    policy = POLICIES[name]
    layer = Layer(policy, policy.init(budget=6, **SETTINGS.get(name, {})), new_log(4))
    outs = []
    for start, end in [(0, 10), *((i, i + 1) for i in range(10, n))]:
        part = slice(start, end)
        layer.lay_out(keys[:, :, part], values[:, :, part])
        outs.append(np.array(layer.attend(queries[:, :, part], scale=0.3)))
    layer.trim(2)
    return outs, layer


@pytest.mark.parametrize("name", ["tova", "h2o", "streaming_llm", "snapkv", "morphkv"])
def test_values_of_another_width(name: str) -> None:
    narrow, small = _run(name, D_V)
    wide, big = _run(name, D)
    for a, b in zip(narrow, wide, strict=True):
        assert a.shape[-1] == D_V
        np.testing.assert_allclose(a, b[..., :D_V], atol=1e-6)
    small_state, big_state = small.view(), big.view()
    assert np.array_equal(
        np.array(small_state.slots.positions), np.array(big_state.slots.positions)
    )
    assert small_state.slots.values.shape[-1] == D_V
    assert small_state.nbytes * 2 * D == big_state.nbytes * (D + D_V)


def test_value_width_is_checked() -> None:
    keys = mx.zeros((1, 2, 3, 8))
    with pytest.raises(ValueError, match="values must be"):
        check_kv(keys, mx.zeros((1, 2, 4, 8)), expect=None, dtype=None)
    with pytest.raises(ValueError, match="D_v"):
        check_kv(keys, mx.zeros((1, 2, 3, 5)), expect=(1, 2, 8), dtype=None, value_dim=4)
