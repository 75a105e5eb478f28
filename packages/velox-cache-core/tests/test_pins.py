"""Pinned spans (velox_cache_core.pins): never evicted, on every policy and path.

- against the references: every policy with a pinned span matches its plain reference that
  never evicts the span's positions either (outputs, what each query sees, the kept rows);
- a prefix pin ``[0, k)`` decides exactly as ``n_sink = k``;
- pins that do not fit, too many spans, or tokens already evicted: ``ValueError``, state kept;
- pinned rows survive long decodes, packed batches, trims and the layer lifecycle.
"""

from __future__ import annotations

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from test_policy_contract import CASES, NAMES, needs_queries, run_against_reference

from velox_cache_core import POLICIES, Layer, new_log
from velox_cache_core.lanes import PAD
from velox_cache_core.packed import pack, packed_update, unpack
from velox_cache_core.pins import MAX_SPANS, count, merged, pin, pin_room, spans
from velox_cache_core.selection import pinned, sinks
from velox_cache_core.store.token_rows import Quant

EXAMPLES = hypothesis_settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def room(name: str, state) -> int:
    """Pinned tokens beyond the sinks that fit ``state`` (pins.py's rule)."""
    found = pin_room(POLICIES[name], state)
    assert found is not None  # every registered policy has a budget
    return found


# ------------------------------------------------------------------------- the masks


def test_pinned_mask_by_hand() -> None:
    positions = mx.array([[[0, 3, 4, 7, 9]], [[1, 2, 5, 6, -1]]], dtype=mx.int32)
    pins = mx.array([[[3, 5], [9, 10]], [[0, 0], [0, 0]]], dtype=mx.int32)
    got = np.array(pinned(positions, pins))
    assert got.tolist() == [[[False, True, True, False, True]], [[False] * 5]]
    # (a padding row at -1 counts as a sink, as without pins)
    assert np.array(sinks(positions, 1, pins)).tolist() == [
        [[True, True, True, False, True]],
        [[False, False, False, False, True]],
    ]


def test_spans_merge_and_count() -> None:
    assert merged([(5, 8), (0, 2), (2, 3), (7, 10)]) == [(0, 3), (5, 10)]
    assert count([(0, 3), (5, 10)], n_sink=2) == 1 + 5


# ----------------------------------------------------------------- against the reference


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.data())
def test_pinned_span_matches_reference(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    settings = data.draw(case.strategy, label="settings")
    state = POLICIES[name].init(**settings)
    full = state.settings
    free = room(name, state)
    prompt = data.draw(harness.chunk_sizes(), label="prompt")
    length = max(sum(prompt), 1)
    size = data.draw(st.integers(1, max(1, min(free, length))), label="pinned")
    start = data.draw(st.integers(0, length - 1), label="start")
    if free < 1:
        return  # nothing beyond the sinks fits: test_pin_that_cannot_fit covers the error
    run_against_reference(
        name,
        settings,
        shape=data.draw(harness.shapes(), label="shape"),
        prompt=prompt,
        decode=(
            data.draw(st.lists(st.integers(0, 3), max_size=4), label="decode")
            if case.prompt_end is not None
            else []
        ),
        give_queries=needs_queries(name, full) or data.draw(st.booleans(), label="queries"),
        scale=data.draw(st.sampled_from([None, 0.3, 1.5]), label="scale"),
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        pins=(start, start + size),
    )


SINK_POLICIES = [n for n in NAMES if "n_sink" in POLICIES[n].setting_names]


@pytest.mark.parametrize("name", SINK_POLICIES)
@pytest.mark.parametrize("chunks", [[1] * 14, [14], [3, 5, 1, 4, 1]])
def test_prefix_pin_equals_sinks(name: str, chunks: list[int]) -> None:
    """Pinning ``[0, k)`` over ``n_sink = 1`` is ``n_sink = k``, bit for bit."""
    policy = POLICIES[name]
    settings = {**CASES[name].settings, "budget": 8}
    k = 3
    pinned_state = pin(policy, policy.init(**{**settings, "n_sink": 1}), 0, k)
    sunk_state = policy.init(**{**settings, "n_sink": k})
    stream = harness.make_stream(2, 2, 2, 8, sum(chunks), seed=3)
    end = CASES[name].prompt_end
    outs = []
    for state in (pinned_state, sunk_state):
        state, out = harness.run_engine(policy.update, state, stream, chunks)
        if end is not None:
            state = end(state)
        outs.append((state, out))
    (a, out_a), (b, out_b) = outs
    np.testing.assert_array_equal(out_a, out_b)
    assert harness.state_positions(a) == harness.state_positions(b)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", NAMES)
def test_pin_that_cannot_fit(name: str) -> None:
    policy = POLICIES[name]
    state = policy.init(**{**CASES[name].settings, "budget": 8})
    free = room(name, state)
    start = 100
    assert spans(pin(policy, state, start, start + max(free, 1)).pins) or free < 1
    with pytest.raises(ValueError, match="would not fit"):
        pin(policy, state, start, start + free + 1)
    assert state.pins is None


def test_pin_arguments_are_checked() -> None:
    policy = POLICIES["tova"]
    state = policy.init(budget=64, n_sink=2)
    with pytest.raises(TypeError, match="start must be an int"):
        pin(policy, state, 1.0, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        pin(policy, state, -1, 4)
    with pytest.raises(ValueError, match="stop must be > start"):
        pin(policy, state, 4, 4)
    for i in range(MAX_SPANS):
        state = pin(policy, state, 10 * i + 3, 10 * i + 5)
    with pytest.raises(ValueError, match=f"at most {MAX_SPANS} disjoint"):
        pin(policy, state, 50, 52)
    assert spans(pin(policy, state, 4, 14).pins) == [(3, 15), (23, 25), (33, 35)]


def test_pin_of_evicted_tokens_is_refused() -> None:
    policy = POLICIES["streaming_llm"]
    state = policy.init(budget=6, n_sink=1)
    keys, values, _ = harness.make_stream(1, 2, 1, 4, 12, seed=0)
    state = policy.update(state, mx.array(keys), mx.array(values)).state
    kept = harness.state_positions(state)[0][0]
    assert kept == [0, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="already evicted 2 of its tokens"):
        pin(policy, state, 5, 9)
    assert state.pins is None
    assert spans(pin(policy, state, 8, 12).pins) == [(8, 12)]


# ----------------------------------------------------------------------- every path


@pytest.mark.parametrize("name", NAMES)
def test_pinned_rows_survive_a_long_decode(name: str) -> None:
    """A pinned span in the middle of the prompt is kept through 40 decode steps, on the
    layer (fast decode steps included), with the budget held."""
    policy = POLICIES[name]
    settings = {**CASES[name].settings, "budget": 12}
    layer = Layer(policy, policy.init(**settings), new_log(8))
    layer.pin(5, 8)
    keys, values, queries = harness.make_stream(1, 2, 2, 8, 70, seed=1)

    def feed(a: int, b: int) -> None:
        layer.lay_out(mx.array(keys[:, :, a:b]), mx.array(values[:, :, a:b]))
        layer.attend(mx.array(queries[:, :, a:b]), 0.35)

    feed(0, 30)
    layer.end_prompt()
    for t in range(30, 70):
        feed(t, t + 1)
        kept = harness.state_positions(layer.view())
        assert kept is not None
        for row in kept[0]:
            assert {5, 6, 7} <= set(row), (t, row)
    if CASES[name].prompt_end is None:
        assert layer.view().n_kept <= 12


@pytest.mark.parametrize("name", ["tova", "h2o", "streaming_llm"])
def test_trim_keeps_pins(name: str) -> None:
    policy = POLICIES[name]
    layer = Layer(policy, policy.init(**{**CASES[name].settings, "budget": 10}), new_log(8))
    keys, values, queries = harness.make_stream(1, 2, 2, 8, 30, seed=2)
    for t in range(24):
        layer.lay_out(mx.array(keys[:, :, t : t + 1]), mx.array(values[:, :, t : t + 1]))
        layer.attend(mx.array(queries[:, :, t : t + 1]), 0.35)
        if t == 20:
            layer.pin(20, 23)
    layer.trim(5)  # back before the pin call: the span stays pinned
    assert spans(layer.view().pins) == [(20, 23)]
    assert layer.view().offset == 19


@pytest.mark.parametrize("name", [n for n in NAMES if POLICIES[n].packs_rows])
def test_packed_rows_equal_each_row_alone(name: str) -> None:
    """Rows with different pins (and one without) decode packed exactly as alone."""
    policy = POLICIES[name]
    settings = {**CASES[name].settings, "budget": 8}
    rows = []
    for b, span in enumerate([(2, 5), None, (6, 8)]):
        state = policy.init(**settings)
        if span is not None:
            state = pin(policy, state, *span)
        keys, values, queries = harness.make_stream(1, 2, 2, 8, 12 + b, seed=10 + b)
        state, _ = harness.run_engine(policy.update, state, (keys, values, queries), [12 + b])
        rows.append(state)
    alone = []
    steps = harness.make_stream(3, 2, 2, 8, 6, seed=99)
    for b, state in enumerate(rows):
        for t in range(6):
            part = slice(t, t + 1)
            state = policy.update(
                state,
                mx.array(steps[0][b : b + 1, :, part]),
                mx.array(steps[1][b : b + 1, :, part]),
                queries=mx.array(steps[2][b : b + 1, :, part]),
            ).state
        alone.append(state)
    packed = pack(policy, rows, [None] * 3)
    for t in range(6):
        part = slice(t, t + 1)
        _, packed = packed_update(
            policy,
            packed,
            mx.array(steps[0][:, :, part]),
            mx.array(steps[1][:, :, part]),
            mx.array(steps[2][:, :, part]),
            None,
        )
    back, _ = unpack(packed)
    for got, want in zip(back, alone, strict=True):
        assert harness.state_positions(got) == harness.state_positions(want)
        harness.assert_same_states(got, want)


@pytest.mark.parametrize(
    ("name", "overrides", "quant"),
    [
        ("tova", {"scope": "head", "signal": "key", "allocation": "head"}, None),
        ("h2o", {"allocation": "head"}, None),
        ("snapkv", {"allocation": "head"}, None),
        ("expected_attention", {"allocation": "head"}, None),
        ("tova", {}, Quant.of(8, 32)),
        ("h2o", {}, Quant.of(4, 32, "channel")),
    ],
    ids=["tova-head", "h2o-head", "snapkv-head", "ea-head", "tova-q8", "h2o-q4-channel"],
)
def test_pins_with_lanes_and_quantized_rows(name: str, overrides: dict, quant) -> None:
    """Adaptive allocation's cut and lanes, and quantized rows, keep the pinned span too."""
    policy = POLICIES[name]
    settings = {**CASES[name].settings, "budget": 12, **overrides}
    layer = Layer(policy, policy.init(**settings), None, quant=quant)
    layer.pin(9, 12)
    keys, values, queries = harness.make_stream(1, 2, 2, 32, 60, seed=4)
    for a, b in [(0, 40), *((t, t + 1) for t in range(40, 60))]:
        layer.lay_out(mx.array(keys[:, :, a:b]), mx.array(values[:, :, a:b]))
        layer.attend(mx.array(queries[:, :, a:b]), 0.2)
        if a == 0:
            layer.end_prompt()
        live = layer.view()._live()  # lanes padded to the fullest head, then later rows
        for row in np.array(live.positions)[0]:
            assert {9, 10, 11} <= set(row[row < PAD].tolist()), (a, row)
