"""The plain numpy TOVA reference (core_reference.py) itself, by hand.

The engine is checked against it, for every policy, in test_policy_contract.py.
"""

from __future__ import annotations

import numpy as np
from core_harness import make_stream
from core_reference import ReferenceTova

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")


def test_reference_key_signal_by_hand() -> None:
    # budget 2; at t=2 the incoming key [3, 0] scores k0=[1, 0] above k1=[0, 1]: k1 goes.
    keys = np.array([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])[None, None]
    values = np.eye(3, 2)[None, None]
    for scope in SCOPES:
        ref = ReferenceTova(2, 0, "key", scope, "sequential")
        ref.feed(keys, values)
        assert ref.positions() == [[[0, 2]]]


def test_reference_query_signal_layer_by_hand() -> None:
    # Two KV heads share one decision: head 0 prefers position 0, head 1 prefers 1 more strongly.
    keys = np.zeros((1, 2, 3, 2))
    keys[0, 0, :, 0] = [2.0, 0.0, 0.0]
    keys[0, 1, :, 0] = [0.0, 4.0, 0.0]
    queries = np.zeros((1, 2, 3, 2))
    queries[..., 0] = 1.0
    ref = ReferenceTova(2, 0, "query", "layer", "sequential")
    ref.feed(keys, np.zeros_like(keys), queries, scale=1.0)
    # Head 0 weights ~ e^[2, 0, 0], head 1 ~ e^[0, 4, 0]; position 2 lowest in the mean.
    assert ref.positions() == [[[0, 1], [0, 1]]]
    head = ReferenceTova(2, 0, "query", "head", "sequential")
    head.feed(keys, np.zeros_like(keys), queries, scale=1.0)
    # Per head: ties between the two zero-logit tokens evict the lower position.
    assert head.positions() == [[[0, 2], [1, 2]]]


def test_reference_ties_evict_lowest_position() -> None:
    # Identical keys give identical weights: TOVA then slides a window behind the sinks.
    keys = np.ones((1, 1, 8, 4))
    ref = ReferenceTova(3, 1, "key", "head", "sequential")
    ref.feed(keys, keys)
    assert ref.positions() == [[[0, 6, 7]]]


def test_reference_oneshot_by_hand() -> None:
    # One chunk of 4, budget 2: the last query's weights keep the two best candidates.
    keys = np.zeros((1, 1, 4, 2))
    keys[0, 0, :, 0] = [3.0, -1.0, 2.0, 0.0]
    queries = np.zeros((1, 1, 4, 2))
    queries[..., 0] = 1.0
    ref = ReferenceTova(2, 0, "query", "layer", "oneshot")
    ref.feed(keys, keys, queries, scale=1.0)
    assert ref.positions() == [[[0, 2]]]
    assert ref.last_visible[0][0] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    # The sequential run differs: query 3 no longer sees position 1 (evicted at step 2).
    seq = ReferenceTova(2, 0, "query", "layer", "sequential")
    seq.feed(keys, keys, queries, scale=1.0)
    assert seq.positions() == [[[0, 2]]]
    assert seq.last_visible[0][0] == [[0], [0, 1], [0, 1, 2], [0, 2, 3]]


def test_reference_oneshot_single_token_is_sequential() -> None:
    keys, values, queries = make_stream(2, 2, 2, 8, 20, seed=7)
    for signal in SIGNALS:
        for scope in SCOPES:
            a = ReferenceTova(5, 2, signal, scope, "oneshot")
            b = ReferenceTova(5, 2, signal, scope, "sequential")
            for i in range(20):
                out_a, pos_a = a.feed(
                    keys[:, :, i : i + 1], values[:, :, i : i + 1], queries[:, :, i : i + 1]
                )
                out_b, pos_b = b.feed(
                    keys[:, :, i : i + 1], values[:, :, i : i + 1], queries[:, :, i : i + 1]
                )
                assert pos_a == pos_b
                np.testing.assert_array_equal(out_a, out_b)
