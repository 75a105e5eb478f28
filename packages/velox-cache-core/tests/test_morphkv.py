"""MorphKV against the numpy reference (reference_siblings.ReferenceMorphKV): TOVA's weights fused
over the last `window` probe rows; `window=1` is TOVA bit for bit."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from velox_cache_core import (
    MorphKVState,
    init_morphkv_state,
    init_tova_state,
    morphkv_update,
    tova_update,
)

support = sys.modules["velox_core_tests"]  # loaded by conftest.py

helpers = support.helpers
harness = support.sibling_harness
ReferenceMorphKV = support.reference_siblings.ReferenceMorphKV

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SIGNALS, SCOPES, PREFILLS = ("query", "key"), ("layer", "head"), ("sequential", "oneshot")


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    budget = draw(st.integers(1, 10))
    n_sink = draw(st.integers(0, budget - 1))
    signal = draw(st.sampled_from(SIGNALS))
    return {
        "shape": draw(harness.shapes()),
        "options": {
            "budget": budget,
            "n_sink": n_sink,
            "window": draw(st.integers(1, budget - n_sink + 1)),
            "fusion": draw(st.sampled_from(("mean", "max"))),
            "signal": signal,
            "scope": draw(st.sampled_from(SCOPES)),
            "prefill": draw(st.sampled_from(PREFILLS)),
        },
        "give_queries": signal == "query" or draw(st.booleans()),
        "scale": draw(st.sampled_from([None, None, 0.5])),
        "chunks": draw(harness.chunk_sizes()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def run_scenario(scn: dict, close_call=assume) -> ReferenceMorphKV:
    stream = harness.make_stream(*scn["shape"], sum(scn["chunks"]), scn["seed"])
    ref = ReferenceMorphKV(**scn["options"])
    harness.run_stream(
        helpers,
        morphkv_update,
        init_morphkv_state(**scn["options"]),
        ref,
        stream,
        scn["chunks"],
        give_queries=scn["give_queries"],
        scale=scn["scale"],
        close_call=close_call,
    )
    return ref


@SETTINGS
@given(scenarios())
def test_engine_matches_reference(scn: dict) -> None:
    run_scenario(scn)


@pytest.mark.parametrize("fusion", ("mean", "max"))
@pytest.mark.parametrize("prefill", PREFILLS)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("signal", SIGNALS)
def test_engine_matches_reference_every_combination(signal, scope, prefill, fusion) -> None:
    # Fixed, eviction-heavy streams so every combination runs whatever hypothesis draws.
    for seed, chunks in enumerate([[1] * 16, [7, 0, 1, 6, 3], [16], [4, 4, 4, 4]]):
        run_scenario(
            {
                "shape": (2, 2, 2, 8),
                "options": {
                    "budget": 6,
                    "n_sink": 1,
                    "window": 3,
                    "fusion": fusion,
                    "signal": signal,
                    "scope": scope,
                    "prefill": prefill,
                },
                "give_queries": seed % 2 == 0 or signal == "query",
                "scale": None,
                "chunks": chunks,
                "seed": 4000 + seed,
            },
            close_call=harness.assert_clear,
        )


@SETTINGS
@given(
    splits=harness.two_splits(),
    budget=st.integers(1, 10),
    fractions=st.tuples(st.floats(0, 0.99), st.floats(0, 1)),
    fusion=st.sampled_from(("mean", "max")),
    signal=st.sampled_from(SIGNALS),
    scope=st.sampled_from(SCOPES),
    shape=harness.shapes(),
    seed=st.integers(0, 2**31 - 1),
)
def test_sequential_is_chunk_invariant(
    splits, budget, fractions, fusion, signal, scope, shape, seed
):
    length, split_a, split_b = splits
    n_sink = int(fractions[0] * budget)
    options = {
        "budget": budget,
        "n_sink": n_sink,
        "window": 1 + int(fractions[1] * (budget - n_sink)),
        "fusion": fusion,
        "signal": signal,
        "scope": scope,
        "prefill": "sequential",
    }
    stream = harness.make_stream(*shape, length, seed)
    ref = ReferenceMorphKV(**options)
    ref.feed(*stream)
    assume(ref.min_margin > harness.MIN_MARGIN)
    state_a, out_a = harness.run_engine(
        morphkv_update, init_morphkv_state(**options), stream, split_a, helpers
    )
    state_b, out_b = harness.run_engine(
        morphkv_update, init_morphkv_state(**options), stream, split_b, helpers
    )
    harness.assert_same_states(helpers, state_a, state_b)
    assert helpers.state_positions(state_a) == (ref.positions() if length else None)
    np.testing.assert_allclose(out_a, out_b, atol=harness.ATOL, rtol=harness.RTOL)


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
            helpers,
            morphkv_update,
            state,
            ref,
            (keys, values, queries),
            [1] * 40,
            close_call=harness.assert_clear,
        )
        kept[fusion] = helpers.state_positions(state)
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
        for row in helpers.state_positions(state)[0]:
            assert {0, 1} <= set(row) or t < 2
            assert set(range(max(0, t - 2), t + 1)) <= set(row)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="fusion"):
        init_morphkv_state(budget=8, n_sink=1, window=2, fusion="sum")
    with pytest.raises(ValueError, match="window"):
        init_morphkv_state(budget=8, n_sink=2, window=8)
    init_morphkv_state(budget=8, n_sink=2, window=7)
    with pytest.raises(ValueError, match="window"):
        init_morphkv_state(budget=8, n_sink=2, window=0)
    with pytest.raises(TypeError, match="window"):
        init_morphkv_state(budget=8, n_sink=2, window=2.0)  # type: ignore[arg-type]


def test_reference_window_one_is_tova_reference() -> None:
    tova_reference = support.reference.ReferenceTova
    keys, values, queries = harness.make_stream(2, 2, 2, 8, 18, seed=6)
    for prefill in PREFILLS:
        for scope in SCOPES:
            a = tova_reference(5, 1, "query", scope, prefill)
            b = ReferenceMorphKV(5, 1, 1, "max", "query", scope, prefill)
            for lo, hi in ((0, 7), (7, 8), (8, 18)):
                part = slice(lo, hi)
                out_a, pos_a = a.feed(keys[:, :, part], values[:, :, part], queries[:, :, part])
                out_b, pos_b = b.feed(keys[:, :, part], values[:, :, part], queries[:, :, part])
                assert pos_a == pos_b
                np.testing.assert_allclose(out_a, out_b, atol=1e-12)
