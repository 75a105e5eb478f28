"""Exact trims: feed a stream in chunks, trim the last ``n`` tokens, compare with a fresh state
fed only the prefix (same chunk boundaries, the last one cut): identical, bit for bit."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core.declarations import running_fields
from velox_cache_core.undo import UndoLog, new_log

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("tova", {"preset": "tova"}),
    ("tova", {"preset": "tova_adapted"}),
    ("tova", {"preset": "tova", "prefill": "oneshot"}),
    ("tova", {"preset": "tova_adapted", "prefill": "oneshot", "scope": "layer"}),
    ("h2o", {}),
    ("h2o", {"scope": "layer", "prefill": "oneshot"}),
    ("h2o", {"signal": "key"}),
    ("morphkv", {"window": 3}),
    ("morphkv", {"window": 2, "prefill": "oneshot", "fusion": "max"}),
    ("streaming_llm", {}),
    ("snapkv", {"window": 2, "kernel": 3}),
]


def _stream(seed: int, n: int, h_kv: int, group: int, d: int = 4, b: int = 1):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h_kv, n, d)).astype(np.float32)
    v = rng.standard_normal((b, h_kv, n, d)).astype(np.float32)
    q = rng.standard_normal((b, h_kv * group, n, d)).astype(np.float32)
    return mx.array(k), mx.array(v), mx.array(q)


def _feed(policy: Any, state: Any, stream: Any, sizes: list[int], log: UndoLog | None) -> Any:
    k, v, q = stream
    start = state.offset
    for size in sizes:
        part = slice(start, start + size)
        step = policy.update(state, k[:, :, part], v[:, :, part], q[:, :, part], log=log)
        state, log = step.state, step.log
        start += size
    return state, log


def _canonical(state: Any) -> dict[str, Any]:
    """Live rows sorted by position, running fields aligned the same way, counters."""
    out: dict[str, Any] = {"offset": state.offset, "tokens_seen": state.tokens_seen}
    if state.slots is None:
        return out
    live = state.slots.compact()
    order = np.argsort(np.array(live.positions), axis=-1)
    out["positions"] = np.take_along_axis(np.array(live.positions), order, -1)
    for name in ("keys", "values"):
        out[name] = np.take_along_axis(np.array(getattr(live, name)), order[..., None], 2)
    for name in running_fields(state):
        value = getattr(state, name)
        if name in ("slots", "offset", "tokens_seen"):
            continue
        if name == "scores" and value is not None:  # slot-aligned: same order as the rows
            groups = value.shape[1]
            slot_idx = state.slots.live_index()
            scores = np.array(value)
            if slot_idx is not None:
                scores = np.take_along_axis(scores, np.array(slot_idx)[:, :groups], -1)
            out[name] = np.take_along_axis(scores, order[:, :groups], -1)
        elif isinstance(value, mx.array):
            out[name] = np.array(value)
        elif value is not None and hasattr(value, "probes"):
            out[name] = (np.array(value.probes), np.array(value.positions))
        else:
            out[name] = value
    return out


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            for xi, yi in zip(x, y, strict=True):
                np.testing.assert_array_equal(xi, yi, err_msg=key)
        elif isinstance(x, np.ndarray):
            if key == "scores":  # running sums: the same additions, maybe in another grouping
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=key)
            else:
                np.testing.assert_array_equal(x, y, err_msg=key)
        else:
            assert x == y, key


@settings(max_examples=60, deadline=None)
@given(
    variant=st.sampled_from(range(len(VARIANTS))),
    budget=st.integers(4, 9),
    group=st.sampled_from([1, 2]),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=9),
    window=st.integers(1, 8),
    data=st.data(),
)
def test_trim_equals_feeding_the_prefix(
    variant: int, budget: int, group: int, chunks: list[int], window: int, data: Any
) -> None:
    name, options = VARIANTS[variant]
    policy = POLICIES[name]
    sinks = {} if name == "snapkv" else {"n_sink": 1}
    fresh = policy.init(budget=budget, **sinks, **options)
    total = sum(chunks)
    stream = _stream(data.draw(st.integers(0, 10**6)), total, h_kv=2, group=group)
    state, log = _feed(policy, fresh, stream, chunks, new_log(window))
    assert log is not None and log.tokens <= total
    n = data.draw(st.integers(0, log.tokens))
    trimmed, log_after = policy.trim(state, log, n)
    assert log_after.tokens == log.tokens - n
    cut, sizes = total - n, []
    for size in chunks:
        if sum(sizes) + size > cut:
            sizes.append(cut - sum(sizes))
            break
        sizes.append(size)
    expected, _ = _feed(policy, fresh, stream, [s for s in sizes if s], None)
    _assert_same(_canonical(trimmed), _canonical(expected))
    # Feeding on after the trim goes on exactly as the prefix's state would.
    more = _stream(7, cut + 3, h_kv=2, group=group)
    a, _ = _feed(policy, trimmed, more, [3], log_after)
    b, _ = _feed(policy, expected, more, [3], None)
    _assert_same(_canonical(a), _canonical(b))


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=lambda x: str(x))
def test_speculative_rounds(name: str, options: dict[str, Any]) -> None:
    """Rounds of a 4-token verification chunk, trimming 0-3 rejected tokens each time."""
    policy = POLICIES[name]
    sinks = {} if name == "snapkv" else {"n_sink": 1}
    fresh = policy.init(budget=6, **sinks, **options)
    stream = _stream(3, 80, h_kv=2, group=2)
    rng = np.random.default_rng(1)
    state, log = _feed(policy, fresh, stream, [9], new_log(4))
    prefix = [9]
    for _ in range(12):
        state, log = _feed(policy, state, stream, [4], log)
        rejected = int(rng.integers(0, 4))
        state, log = policy.trim(state, log, rejected)
        prefix.append(4 - rejected)
    expected, _ = _feed(policy, fresh, stream, prefix, None)
    _assert_same(_canonical(state), _canonical(expected))


def test_trim_beyond_the_log_raises_and_changes_nothing() -> None:
    policy = POLICIES["tova"]
    stream = _stream(0, 12, h_kv=2, group=2)
    state, log = _feed(policy, policy.init(budget=4, n_sink=1), stream, [5, 1, 1], new_log(2))
    assert log is not None and log.tokens == 2
    with pytest.raises(ValueError, match="cannot trim 3 tokens"):
        policy.trim(state, log, 3)
    with pytest.raises(ValueError, match="n must be"):
        policy.trim(state, log, -1)
    after, _ = policy.trim(state, log, 2)
    assert after.offset == 5


def test_a_call_longer_than_the_window_clears_the_log() -> None:
    policy = POLICIES["tova"]
    stream = _stream(0, 20, h_kv=1, group=1)
    _, log = _feed(policy, policy.init(budget=4, n_sink=1), stream, [1, 1, 9], new_log(8))
    assert log is not None and log.tokens == 0 and log.nbytes == 0
    with pytest.raises(ValueError, match="trim_window"):
        new_log(-1)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=lambda x: str(x))
def test_trimming_decode_steps(name: str, options: dict[str, Any]) -> None:
    """Decode steps that each evict (and write over the slot the step before freed), trimmed
    back one to eight at a time."""
    policy = POLICIES[name]
    sinks = {} if name == "snapkv" else {"n_sink": 1}
    fresh = policy.init(budget=5, **sinks, **options)
    stream = _stream(5, 30, h_kv=2, group=2)
    chunks = [9] + [1] * 12
    state, log = _feed(policy, fresh, stream, chunks, new_log(8))
    for n in range(1, 9):
        trimmed, _ = policy.trim(state, log, n)
        expected, _ = _feed(policy, fresh, stream, chunks[: len(chunks) - n], None)
        _assert_same(_canonical(trimmed), _canonical(expected))
