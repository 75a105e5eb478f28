"""What is special to SnapKV: `snapkv_compress` at the end of the prompt (the window plus the
best avg_pool1d-smoothed scores), never evicting otherwise. Agreement with the numpy reference
(core_reference_siblings.ReferenceSnapKV, prompt end and decode included), prompt-split
invariance and the shared guarantees are in test_policy_contract.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from core_harness import make_stream, state_positions
from core_reference_siblings import ReferenceSnapKV

from velox_cache_core import SnapKVState, init_snapkv_state, snapkv_compress, snapkv_update


def test_compress_fresh_and_below_budget() -> None:
    fresh = init_snapkv_state(budget=8, window=2)
    assert isinstance(fresh, SnapKVState)
    done = snapkv_compress(fresh)
    assert done.compressed and done.n_kept == 0
    keys, values, queries = make_stream(1, 2, 2, 4, 5, seed=0)
    state = snapkv_update(fresh, mx.array(keys), mx.array(values), mx.array(queries)).state
    done = snapkv_compress(state)
    assert done.compressed and state_positions(done) == [[list(range(5))] * 2]
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
    kept = state_positions(snapkv_compress(state))
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
    keys, values, queries = make_stream(1, 1, 1, 4, 12, seed=4)
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


@pytest.mark.parametrize(("budget", "window"), [(2, 1), (8, 7), (32, 31), (33, 32), (512, 32)])
def test_default_window_fits_the_budget(budget: int, window: int) -> None:
    # The default window is the paper's 32 where the budget leaves room for it, else budget - 1.
    assert init_snapkv_state(budget=budget).window == window


def test_explicit_window_is_still_checked() -> None:
    with pytest.raises(ValueError, match="window must be < budget"):
        init_snapkv_state(budget=8, window=8)
    with pytest.raises(TypeError, match="window"):
        init_snapkv_state(budget=8, window=2.0)  # type: ignore[arg-type]
