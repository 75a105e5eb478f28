"""Quantized rows (``kv_bits``): every policy at every width keeps, scores and attends over
quantized rows exactly as its numpy reference does over the same rows dequantized; MLX's
quantization itself is checked against a plain numpy quantizer; the store's bytes are what it
holds; bad settings are refused by name.
"""

from __future__ import annotations

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_policy_contract import CASES, EXAMPLES, NAMES, needs_queries, run_against_reference

from velox_cache_core import POLICIES
from velox_cache_core.layer import Layer
from velox_cache_core.store.rows import row_bytes
from velox_cache_core.store.token_rows import BITS, QRows, Quant
from velox_cache_core.undo import new_log

WIDTHS = (8, 4, 2)
D = 32  # the smallest head_dim a group of 32 divides


def numpy_quantize(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Affine quantization per group of ``group`` features, dequantized (float64), as MLX
    defines it: the group's larger-magnitude extreme (the edge) is represented exactly, the
    step is ``edge / round(edge / ((max - min) / (2**bits - 1)))``; at 1 bit the levels are
    the group's minimum and maximum."""
    n_bins = 2**bits - 1
    g = x.astype(np.float64).reshape(*x.shape[:-1], -1, group)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    if bits == 1:
        return (np.round((g - lo) / (hi - lo)) * (hi - lo) + lo).reshape(x.shape)
    low_edge = np.abs(lo) > np.abs(hi)
    step = np.maximum((hi - lo) / n_bins, 1e-7)
    step = np.where(low_edge, step, -step)
    edge = np.where(low_edge, lo, hi)
    q0 = np.round(edge / step)
    step = np.where(q0 != 0, edge / np.where(q0 == 0, 1, q0), step)
    bias = np.where(q0 == 0, 0.0, edge)
    q = np.clip(np.round((g - bias) / step), 0, n_bins)
    return (q * step + bias).reshape(x.shape)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_quantization_matches_numpy(bits: int, group: int) -> None:
    rng = np.random.default_rng(bits * 1000 + group)
    x = (rng.standard_normal((2, 3, 5, 128)) * rng.uniform(0.1, 4, (2, 3, 5, 1))).astype(np.float32)
    x[0, 0, 0, 7] = 40.0  # an outlier channel, as keys have
    rows = Quant(bits, group).quantize(mx.array(x))
    assert rows.shape == x.shape and rows.dtype == mx.float32
    assert rows.packed.dtype == mx.uint32 and rows.packed.shape[-1] == 128 * bits // 32
    assert rows.scales.shape[-1] == rows.biases.shape[-1] == 128 // group
    got = np.array(rows.dense()).astype(np.float64)
    want = numpy_quantize(x, bits, group)
    step = np.abs(np.array(rows.scales)).repeat(group, axis=-1)
    # Equal but where float32 rounding puts an element on the other side of a rounding tie.
    off = np.abs(got - want) > 1e-5 * (1 + np.abs(want))
    assert off.mean() < 0.01
    assert np.all(np.abs(got - want)[off] <= step[off] * 1.001)
    assert np.mean(np.abs(got - x) / step) < 0.5  # within half a step, but for clipped extremes


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("name", NAMES)
def test_every_policy_over_quantized_rows(name: str, bits: int) -> None:
    every_chunking(name, Quant(bits, 32), head_dim=D, seed=2000 + bits)


def every_chunking(name: str, quant: Quant, head_dim: int, seed: int) -> None:
    """``name`` against its reference over rows stored as ``quant`` holds them, prompts fed
    token by token, in uneven chunks and at once (then a few decode steps after a prompt end)."""
    settings = CASES[name].settings
    full = POLICIES[name].init(**settings).settings
    for i, chunks in enumerate([[1] * 14, [6, 0, 1, 5, 2], [14]]):
        run_against_reference(
            name,
            settings,
            shape=(2, 2, 2, head_dim),
            prompt=chunks,
            decode=[1, 1, 2] if CASES[name].prompt_end is not None else [],
            give_queries=i % 2 == 0 or needs_queries(name, full),
            scale=None,
            seed=seed + i,
            close_call=harness.assert_clear,
            quant=quant,
        )


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.data())
def test_quantized_rows_match_reference(name: str, data: st.DataObject) -> None:
    """Random settings, chunkings, batch rows, KV heads and GQA ratios, at every width."""
    case = CASES[name]
    settings = data.draw(case.strategy, label="settings")
    full = POLICIES[name].init(**settings).settings
    n_batch = data.draw(st.integers(1, 2), label="B")
    n_kv = data.draw(st.integers(1, 3), label="H_kv")
    ratio = data.draw(st.integers(1, 3), label="GQA ratio")
    run_against_reference(
        name,
        settings,
        shape=(n_batch, n_kv, ratio, D),
        prompt=data.draw(harness.chunk_sizes(), label="prompt"),
        decode=(
            data.draw(st.lists(st.integers(0, 3), max_size=4), label="decode")
            if case.prompt_end is not None
            else []
        ),
        give_queries=needs_queries(name, full) or data.draw(st.booleans(), label="queries"),
        scale=None,
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        quant=Quant(data.draw(st.sampled_from(WIDTHS), label="bits"), 32),
    )


def _layer_run(name: str, quant: Quant | None, n: int = 40, trim: int = 0) -> Layer:
    rng = np.random.default_rng(7)  # the same stream whatever n: runs of n and n - k agree
    keys = mx.array(rng.standard_normal((1, 2, 64, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 2, 64, 64)).astype(np.float32))
    queries = mx.array(rng.standard_normal((1, 4, 64, 64)).astype(np.float32))
    policy = POLICIES[name]
    # expected_attention un-rotates its queries: it needs the model's RoPE base
    rope = {"rope_base": 1e4} if "rope_base" in policy.setting_names else {}
    layer = Layer(policy, policy.init(budget=16, **rope), new_log(8), quant=quant)
    for start, end in [(0, 24), *((i, i + 1) for i in range(24, n))]:
        layer.lay_out(keys[:, :, start:end], values[:, :, start:end])
        layer.attend(queries[:, :, start:end], scale=0.125)
    if trim:
        layer.trim(trim)
    return layer


@pytest.mark.parametrize("bits", WIDTHS)
def test_nbytes_counts_packed_rows_scales_and_biases(bits: int) -> None:
    state = _layer_run("tova", Quant(bits, 64)).view()
    slots = state.slots
    assert isinstance(slots.keys, QRows) and isinstance(slots.values, QRows)
    per_row = 2 * 2 * (64 * bits // 32 * 4 + 2 * (64 // 64) * 4)  # H * (K + V) * words, scales
    assert row_bytes(slots.keys) + row_bytes(slots.values) == per_row
    assert state.nbytes == slots.n_held * per_row
    held = sum(a.nbytes for a in slots.keys.arrays() + slots.values.arrays())
    assert state.nbytes == held  # no reserve past the budget: every held array is counted
    plain = _layer_run("tova", None).view()
    assert state.nbytes / plain.nbytes == pytest.approx((bits + 2 * 32 / 64) / 32)


@pytest.mark.parametrize("name", NAMES)
def test_trim_is_exact_on_quantized_rows(name: str) -> None:
    trimmed = _layer_run(name, Quant(4, 64), n=40, trim=3).view()
    fresh = _layer_run(name, Quant(4, 64), n=37).view()
    assert harness.state_positions(trimmed) == harness.state_positions(fresh)
    np.testing.assert_array_equal(
        np.array(harness.sorted_state(trimmed)[1]), np.array(harness.sorted_state(fresh)[1])
    )


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kv_bits must be one of 1, 2, 3, 4, 5, 6, 8, got 7"):
        Quant(7)
    with pytest.raises(TypeError, match="kv_bits must be an int"):
        Quant(4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kv_group_size must be one of 32, 64, 128, got 16"):
        Quant(4, 16)
    with pytest.raises(ValueError, match=r"kv_group_size=64 must divide the keys' head_dim=32"):
        layer = Layer(POLICIES["tova"], POLICIES["tova"].init(budget=8), None, quant=Quant(4, 64))
        layer.lay_out(mx.zeros((1, 1, 2, 32)), mx.zeros((1, 1, 2, 32)))
    with pytest.raises(TypeError, match="quant must be a Quant"):
        Layer(POLICIES["tova"], POLICIES["tova"].init(budget=8), None, quant=4)  # type: ignore[arg-type]


def test_a_quantized_store_refuses_full_precision_rows_and_back() -> None:
    policy = POLICIES["tova"]
    keys = mx.zeros((1, 1, 2, 32))
    state = policy.update(policy.init(budget=8), keys, keys, queries=keys).state
    q = Quant(4, 32).quantize(keys)
    with pytest.raises(TypeError, match="state holds full-precision rows"):
        policy.update(state, q, q, queries=keys)
    qstate = policy.update(policy.init(budget=8), q, q, queries=keys).state
    with pytest.raises(TypeError, match="state holds rows quantized"):
        policy.update(qstate, keys, keys, queries=keys)
    other = Quant(8, 32).quantize(keys)
    with pytest.raises(TypeError, match="state holds rows quantized"):
        policy.update(qstate, other, other, queries=keys)


def test_feature_indexing_is_refused() -> None:
    rows = Quant(4, 32).quantize(mx.zeros((1, 1, 2, 32)))
    assert rows[:, :, :1].shape == (1, 1, 1, 32)
    with pytest.raises(ValueError, match="cannot be indexed along their features"):
        rows[..., :16]
