"""What is special to MorphKV: TOVA's weights fused (mean or max) over the last `window` probe
rows, a recent window that survives, and `window=1` is TOVA bit for bit. Agreement with the numpy
reference (core_reference_siblings.ReferenceMorphKV), chunk invariance and the shared guarantees
are in test_policy_contract.py."""

from __future__ import annotations

import core_harness as harness
import mlx.core as mx
import numpy as np
from core_reference import ReferenceTova
from core_reference_siblings import ReferenceMorphKV
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox_cache_core import (
    MorphKVState,
    init_morphkv_state,
    init_tova_state,
    morphkv_update,
    tova_update,
)

SIGNALS, SCOPES, PREFILLS = ("query", "key"), ("layer", "head"), ("sequential", "oneshot")


# -------------------------------------------------------------- window 1 is TOVA exactly


def _same_array(a, b, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, what
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=what)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=harness.shapes(),
    budget=st.integers(1, 10),
    sink_fraction=st.floats(0, 0.99),
    signal=st.sampled_from(SIGNALS),
    scope=st.sampled_from(SCOPES),
    prefill=st.sampled_from(PREFILLS),
    fusion=st.sampled_from(("mean", "max")),
    give_queries=st.booleans(),
    chunks=harness.chunk_sizes(),
    seed=st.integers(0, 2**31 - 1),
)
def test_window_one_is_tova_bit_for_bit(
    shape, budget, sink_fraction, signal, scope, prefill, fusion, give_queries, chunks, seed
) -> None:
    options = {
        "budget": budget,
        "n_sink": int(sink_fraction * budget),
        "signal": signal,
        "scope": scope,
        "prefill": prefill,
    }
    give_queries = give_queries or signal == "query"
    keys, values, queries = harness.make_stream(*shape, sum(chunks), seed)
    tova = init_tova_state(**options)
    morph = init_morphkv_state(window=1, fusion=fusion, **options)
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        args = (mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        q = mx.array(queries[:, :, part]) if give_queries else None
        a, b = tova_update(tova, *args, queries=q), morphkv_update(morph, *args, queries=q)
        for what in ("keys", "values", "mask"):
            _same_array(getattr(a, what), getattr(b, what), f"step.{what} after {start + size}")
        tova, morph = a.state, b.state
        for what in ("keys", "values", "positions"):
            _same_array(getattr(tova, what), getattr(morph, what), f"state.{what}")
        assert (tova.slots is None) == (morph.slots is None)
        if tova.slots is not None:
            _same_array(tova.slots.free, morph.slots.free, "slots.free")
        assert (tova.offset, tova.tokens_seen, tova.n_kept) == (
            morph.offset,
            morph.tokens_seen,
            morph.n_kept,
        )
        start += size


# --------------------------------------------------------------- what MorphKV alone does


def test_fusion_max_and_mean_differ() -> None:
    keys, values, queries = harness.make_stream(1, 2, 2, 8, 40, seed=11)
    kept = {}
    for fusion in ("mean", "max"):
        options = {"budget": 8, "n_sink": 1, "window": 4, "fusion": fusion}
        state = init_morphkv_state(**options)
        ref = ReferenceMorphKV(**options, signal="query", scope="layer", prefill="sequential")
        state = harness.run_stream(
            morphkv_update,
            state,
            ref,
            (keys, values, queries),
            [1] * 40,
            close_call=harness.assert_clear,
        )
        kept[fusion] = harness.state_positions(state)
    assert kept["mean"] != kept["max"]


def test_defaults_follow_tova_preset() -> None:
    state = init_morphkv_state(budget=16)
    assert isinstance(state, MorphKVState)
    assert (state.n_sink, state.window, state.fusion) == (4, 8, "mean")
    assert (state.signal, state.scope, state.prefill) == ("query", "layer", "sequential")


def test_recent_window_survives() -> None:
    keys, values, queries = harness.make_stream(1, 2, 3, 8, 30, seed=8)
    state = init_morphkv_state(budget=7, n_sink=2, window=4, scope="head")
    for t in range(30):
        part = slice(t, t + 1)
        state = morphkv_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            mx.array(queries[:, :, part]),
        ).state
        for row in harness.state_positions(state)[0]:
            assert {0, 1} <= set(row) or t < 2
            assert set(range(max(0, t - 2), t + 1)) <= set(row)


def test_reference_window_one_is_tova_reference() -> None:
    keys, values, queries = harness.make_stream(2, 2, 2, 8, 18, seed=6)
    for prefill in PREFILLS:
        for scope in SCOPES:
            a = ReferenceTova(5, 1, "query", scope, prefill)
            b = ReferenceMorphKV(5, 1, 1, "max", "query", scope, prefill)
            for lo, hi in ((0, 7), (7, 8), (8, 18)):
                part = slice(lo, hi)
                out_a, pos_a = a.feed(keys[:, :, part], values[:, :, part], queries[:, :, part])
                out_b, pos_b = b.feed(keys[:, :, part], values[:, :, part], queries[:, :, part])
                assert pos_a == pos_b
                np.testing.assert_allclose(out_a, out_b, atol=1e-12)
