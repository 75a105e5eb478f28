"""One query row over full-precision rows on the CPU: ``attend`` runs ``attend_row`` as one
compiled, shapeless call (a store that grows by a row per step keeps one trace). It must give
``attend_row``'s bits for every row count, in any order of calls, and a call of another shape
must never reuse a trace it does not fit. Both are checked against a numpy softmax attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox_cache_core.attention import _ROWS, attend, attend_row
from velox_cache_core.engine import Step


def _numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """``q [B, H_q, 1, D]`` over ``k``/``v [B, H_kv, n, D]``, float64: ``[B, H_q, 1, D_v]``."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = (q.astype(np.float64) * scale) @ k.astype(np.float64).swapaxes(-1, -2)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def _step(keys: mx.array, values: mx.array) -> Step:
    return Step(keys, values, None, None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2),
    H_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    D=st.sampled_from([4, 8, 16]),
    D_v=st.sampled_from([4, 8]),
    rows=st.lists(st.integers(1, 40), min_size=2, max_size=8),
    scale=st.sampled_from([0.125, 0.5]),
    half=st.booleans(),
    views=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_compiled_row_is_attend_row_for_every_row_count(
    B: int,
    H_kv: int,
    group: int,
    D: int,
    D_v: int,
    rows: list[int],
    scale: float,
    half: bool,
    views: bool,
    seed: int,
) -> None:
    """``views``: keys/values are the first rows of larger buffers (a store in its reserve, as
    SnapKV's after its cut), strided, not contiguous arrays."""
    rng = np.random.default_rng(seed)
    dtype = mx.float16 if half else mx.float32
    with mx.stream(mx.cpu):
        for n in rows:  # one trace per shape key; the row count changes from call to call
            q = rng.standard_normal((B, H_kv * group, 1, D)).astype(np.float32)
            extra = 7 if views else 0
            k = rng.standard_normal((B, H_kv, n + extra, D)).astype(np.float32)
            v = rng.standard_normal((B, H_kv, n + extra, D_v)).astype(np.float32)
            queries, keys, values = (mx.array(x).astype(dtype) for x in (q, k, v))
            keys, values = keys[:, :, :n], values[:, :, :n]
            got = attend(queries, _step(keys, values), scale)
            want = attend_row(queries, keys, values, scale)
            assert got.shape == (B, H_kv * group, 1, D_v) and got.dtype == dtype
            np.testing.assert_array_equal(np.array(got), np.array(want))
            tolerance = 2e-2 if half else 1e-5
            exact = _numpy_attention(
                *(np.array(x.astype(mx.float32)) for x in (queries, keys, values)), scale
            )
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), exact, atol=tolerance)


def test_each_shape_gets_its_own_trace() -> None:
    """Calls that differ in batch, heads, widths, dtype or scale never share a trace (the
    trace fixes them); calls that differ only in the row count do."""
    _ROWS.clear()
    rng = np.random.default_rng(0)

    def call(B: int, H_q: int, H_kv: int, D: int, n: int, scale: float = 0.25) -> None:
        q = mx.array(rng.standard_normal((B, H_q, 1, D)).astype(np.float32))
        k = mx.array(rng.standard_normal((B, H_kv, n, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((B, H_kv, n, D)).astype(np.float32))
        with mx.stream(mx.cpu):
            got = attend(q, _step(k, v), scale)
            np.testing.assert_array_equal(np.array(got), np.array(attend_row(q, k, v, scale)))

    call(1, 4, 2, 8, 5)
    call(1, 4, 2, 8, 9)
    assert len(_ROWS) == 1
    call(2, 4, 2, 8, 9)
    call(1, 6, 2, 8, 9)
    call(1, 4, 4, 8, 9)
    call(1, 4, 2, 16, 9)
    call(1, 4, 2, 8, 9, scale=0.5)
    assert len(_ROWS) == 6
