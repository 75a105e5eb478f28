"""SnapKV against the numpy reference (reference_siblings.ReferenceSnapKV): the prompt grows
uncut, `snapkv_compress` keeps the window plus the best pooled scores, later tokens append."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from velox_cache_core import SnapKVState, init_snapkv_state, snapkv_compress, snapkv_update

support = sys.modules["velox_core_tests"]  # loaded by conftest.py

helpers = support.helpers
harness = support.sibling_harness
ReferenceSnapKV = support.reference_siblings.ReferenceSnapKV

SETTINGS = settings(
    max_examples=35,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    budget = draw(st.integers(2, 12))
    signal = draw(st.sampled_from(("query", "key")))
    return {
        "shape": draw(harness.shapes()),
        "options": {
            "budget": budget,
            "window": draw(st.integers(1, budget - 1)),
            "kernel": draw(st.sampled_from((1, 3, 5, 7))),
            "signal": signal,
        },
        "give_queries": signal == "query" or draw(st.booleans()),
        "scale": draw(st.sampled_from([None, None, 0.5])),
        "prompt": draw(harness.chunk_sizes(max_total=24)),
        "decode": draw(st.lists(st.integers(0, 3), max_size=4)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def run_scenario(scn: dict, close_call=assume) -> None:
    prompt, decode = sum(scn["prompt"]), sum(scn["decode"])
    stream = harness.make_stream(*scn["shape"], prompt + decode, scn["seed"])
    options = scn["options"]
    ref = ReferenceSnapKV(**options)
    common = {"give_queries": scn["give_queries"], "scale": scn["scale"], "close_call": close_call}

    def check_no_eviction(step, ref) -> None:
        assert step.state.n_kept == step.state.offset and not step.state.compressed

    state = harness.run_stream(
        helpers,
        snapkv_update,
        init_snapkv_state(**options),
        ref,
        stream,
        scn["prompt"],
        after_call=check_no_eviction,
        **common,
    )
    state = snapkv_compress(state)
    ref.compress()
    close_call(ref.min_margin > harness.MIN_MARGIN)
    assert state.compressed
    assert state.n_kept == min(prompt, options["budget"])
    if prompt:
        harness.check_state(helpers, state, ref, prompt)
    assert snapkv_compress(state) is state

    # After the cut: later tokens append, nothing is evicted.
    keys, values, queries = stream
    start = prompt
    for size in scn["decode"]:
        part = slice(start, start + size)
        step = snapkv_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            queries=mx.array(queries[:, :, part]) if scn["give_queries"] else None,
            scale=scn["scale"],
        )
        ref_out, _ = ref.feed(
            keys[:, :, part], values[:, :, part], queries[:, :, part], scn["scale"]
        )
        harness.check_call(
            helpers,
            step,
            ref,
            ref_out,
            keys,
            keys[:, :, part],
            queries[:, :, part],
            start,
            scn["scale"],
        )
        assert step.state.n_kept == state.n_kept + size and step.state.compressed
        state = step.state
        start += size
    assert state.offset == ref.offset == prompt + decode


@SETTINGS
@given(scenarios())
def test_engine_matches_reference(scn: dict) -> None:
    run_scenario(scn)


@pytest.mark.parametrize("signal", ("query", "key"))
@pytest.mark.parametrize("kernel", (1, 5))
@pytest.mark.parametrize("prompt", ([20], [1] * 20, [6, 1, 13]))
def test_engine_matches_reference_fixed(signal, kernel, prompt) -> None:
    run_scenario(
        {
            "shape": (2, 2, 3, 8),
            "options": {"budget": 8, "window": 3, "kernel": kernel, "signal": signal},
            "give_queries": signal == "query" or kernel == 5,
            "scale": None,
            "prompt": prompt,
            "decode": [1, 1, 2],
            "seed": 3000 + kernel,
        },
        close_call=harness.assert_clear,
    )


@SETTINGS
@given(
    splits=harness.two_splits(),
    shape=harness.shapes(),
    signal=st.sampled_from(("query", "key")),
    seed=st.integers(0, 2**31 - 1),
)
def test_prompt_split_does_not_matter(splits, shape, signal, seed) -> None:
    # The cut depends only on the prompt, not on how it was chunked.
    length, split_a, split_b = splits
    options = {"budget": 6, "window": 2, "kernel": 3, "signal": signal}
    stream = harness.make_stream(*shape, length, seed)
    ref = ReferenceSnapKV(**options)
    ref.feed(*stream)
    ref.compress()
    assume(ref.min_margin > harness.MIN_MARGIN)
    state_a, out_a = harness.run_engine(
        snapkv_update, init_snapkv_state(**options), stream, split_a, helpers
    )
    state_b, out_b = harness.run_engine(
        snapkv_update, init_snapkv_state(**options), stream, split_b, helpers
    )
    np.testing.assert_allclose(out_a, out_b, atol=harness.ATOL, rtol=harness.RTOL)
    state_a, state_b = snapkv_compress(state_a), snapkv_compress(state_b)
    harness.assert_same_states(helpers, state_a, state_b)
    assert helpers.state_positions(state_a) == (ref.positions() if length else None)


# ---------------------------------------------------------------- what SnapKV alone does


def test_compress_fresh_and_below_budget() -> None:
    fresh = init_snapkv_state(budget=8, window=2)
    assert isinstance(fresh, SnapKVState)
    done = snapkv_compress(fresh)
    assert done.compressed and done.n_kept == 0
    keys, values, queries = harness.make_stream(1, 2, 2, 4, 5, seed=0)
    state = snapkv_update(fresh, mx.array(keys), mx.array(values), mx.array(queries)).state
    done = snapkv_compress(state)
    assert done.compressed and helpers.state_positions(done) == [[list(range(5))] * 2]
    assert not state.compressed  # the input state is unchanged


def test_compress_needs_a_snapkv_state() -> None:
    with pytest.raises(TypeError, match="state"):
        snapkv_compress(object())  # type: ignore[arg-type]


def test_window_always_kept_and_pool_by_hand() -> None:
    # One head, key signal, window 1: the last key [s, 0, ...] probes the prompt; pooled scores
    # with kernel 3 favour the neighbourhood of the two aligned keys.
    d, n = 4, 10
    keys = np.zeros((1, 1, n, d), dtype=np.float32)
    keys[0, 0, 2, 0] = 3.0
    keys[0, 0, 6, 0] = 2.0
    keys[0, 0, n - 1, 0] = 1.0
    state = snapkv_update(
        init_snapkv_state(budget=4, window=1, kernel=3, signal="key"),
        mx.array(keys),
        mx.array(keys),
        scale=1.0,
    ).state
    ref = ReferenceSnapKV(4, 1, 3, "key")
    ref.feed(keys, keys, scale=1.0)
    ref.compress()
    kept = helpers.state_positions(snapkv_compress(state))
    assert kept == ref.positions()
    # Scores e^[0,0,3,0,0,0,2,0,0]/Z pooled over 3: every window holding the peak at 2 (1, 2
    # and 3) beats every window holding 6.
    assert kept[0][0] == [1, 2, 3, n - 1]
    prefix = np.exp([0, 0, 3, 0, 0, 0, 2, 0, 0, 1.0])
    probs = (prefix / prefix.sum())[:-1]
    pooled = np.convolve(np.pad(probs, 1), np.ones(3) / 3, mode="valid")
    top = sorted(np.argsort(-pooled, kind="stable")[:3].tolist())
    assert kept[0][0] == [*top, n - 1]


def test_decode_without_compress_never_evicts() -> None:
    keys, values, queries = harness.make_stream(1, 1, 1, 4, 12, seed=4)
    state = init_snapkv_state(budget=3, window=1)
    for t in range(12):
        part = slice(t, t + 1)
        state = snapkv_update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            mx.array(queries[:, :, part]),
        ).state
    assert state.n_kept == 12


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="window"):
        init_snapkv_state(budget=4, window=4)
    with pytest.raises(ValueError, match="kernel"):
        init_snapkv_state(budget=8, window=2, kernel=4)
    with pytest.raises(ValueError, match="kernel"):
        init_snapkv_state(budget=8, window=2, kernel=0)
    with pytest.raises(ValueError, match="signal"):
        init_snapkv_state(budget=8, window=2, signal="value")
