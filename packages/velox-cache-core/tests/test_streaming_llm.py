"""What is special to StreamingLLM: sinks plus the most recent tokens, the oldest non-sink dropped
before attending, queries and scale ignored; and mlx-lm's RotatingKVCache at decode. Agreement
with the numpy reference (core_reference_siblings.ReferenceStreamingLLM), chunk invariance and
the shared guarantees are in test_policy_contract.py."""

from __future__ import annotations

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import init_streaming_llm_state, streaming_llm_update


@pytest.mark.parametrize("chunks", [[20], [1] * 20, [3, 9, 1, 7]])
def test_keeps_sinks_and_most_recent(chunks) -> None:
    keys, values, queries = harness.make_stream(2, 2, 1, 4, 20, seed=5)
    state, _ = harness.run_engine(
        streaming_llm_update,
        init_streaming_llm_state(budget=6, n_sink=2),
        (keys, values, queries),
        chunks,
    )
    assert harness.state_positions(state) == [[[0, 1, 16, 17, 18, 19]] * 2] * 2


def test_chunk_mask_by_hand() -> None:
    # budget 4, 1 sink, one chunk of 6: query i sees sink 0 and positions i-2..i.
    keys, values, _ = harness.make_stream(1, 1, 1, 4, 6, seed=0)
    step = streaming_llm_update(
        init_streaming_llm_state(budget=4, n_sink=1), mx.array(keys), mx.array(values)
    )
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 1, 1, 1, 0],
            [1, 0, 0, 1, 1, 1],
        ],
        dtype=bool,
    )
    assert step.mask.shape == (1, 1, 6, 6)
    np.testing.assert_array_equal(np.array(step.mask)[0, 0], expected)
    assert harness.state_positions(step.state) == [[[0, 3, 4, 5]]]


def test_ignores_queries_and_scale() -> None:
    keys, values, queries = harness.make_stream(1, 2, 2, 4, 9, seed=2)
    state = init_streaming_llm_state(budget=4, n_sink=1)
    plain = streaming_llm_update(state, mx.array(keys), mx.array(values))
    hooked = streaming_llm_update(
        state, mx.array(keys), mx.array(values), mx.array(queries), scale=0.1
    )
    harness.assert_same_states(plain.state, hooked.state)
    np.testing.assert_array_equal(np.array(plain.mask), np.array(hooked.mask))


@pytest.mark.parametrize(
    ("budget", "n_sink", "prompt"), [(6, 2, 0), (6, 2, 4), (5, 0, 3), (4, 3, 2)]
)
def test_decode_matches_mlx_lm_rotating_cache(budget, n_sink, prompt) -> None:
    cache_module = pytest.importorskip("mlx_lm.models.cache")
    length = 18
    keys, values, _ = harness.make_stream(1, 2, 1, 4, length, seed=budget + n_sink + prompt)
    rotating = cache_module.RotatingKVCache(max_size=budget, keep=n_sink)
    state = init_streaming_llm_state(budget=budget, n_sink=n_sink)
    if prompt:  # a prompt that fits the budget: both keep all of it
        part = slice(0, prompt)
        rotating.update_and_fetch(mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        state = streaming_llm_update(
            state, mx.array(keys[:, :, part]), mx.array(values[:, :, part])
        ).state
    for t in range(prompt, length):
        part = slice(t, t + 1)
        theirs, _ = rotating.update_and_fetch(
            mx.array(keys[:, :, part]), mx.array(values[:, :, part])
        )
        step = streaming_llm_update(state, mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        ours = harness.identify_rows(np.array(step.keys), keys)
        found = harness.identify_rows(np.array(theirs), keys)
        assert (ours >= 0).all() and (found >= 0).all()
        assert sorted(ours[0, 0].tolist()) == sorted(found[0, 0].tolist()), f"t={t}"
        assert sorted(ours[0, 1].tolist()) == sorted(found[0, 1].tolist()), f"t={t}"
        state = step.state
        assert rotating.offset == state.offset
