"""Drives an engine policy and its numpy reference (reference_siblings.py) over the same stream
and compares them after every call: retained positions and rows, what each query sees, outputs.

Loaded by file path (pytest runs in importlib mode); `helpers` is passed in by the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

# Decisions closer than this (relative score gap) could flip under fp32 rounding: skip them.
MIN_MARGIN = 1e-4
ATOL = RTOL = 2e-4


@st.composite
def chunk_sizes(draw: st.DrawFn, max_total: int = 24) -> list[int]:
    sizes = draw(st.lists(st.integers(0, 8), max_size=7))
    kept, total = [], 0
    for size in sizes:
        size = min(size, max_total - total)
        kept.append(size)
        total += size
    return kept


@st.composite
def two_splits(draw: st.DrawFn, max_length: int = 24) -> tuple[int, list[int], list[int]]:
    length = draw(st.integers(0, max_length))

    def split() -> list[int]:
        cuts = sorted(draw(st.lists(st.integers(0, length), max_size=6)))
        bounds = [0, *cuts, length]
        return [hi - lo for lo, hi in itertools.pairwise(bounds)]

    return length, split(), split()


def shapes() -> st.SearchStrategy[tuple[int, int, int, int]]:
    """(B, H_kv, GQA ratio, D)."""
    return st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.integers(4, 12))


def make_stream(n_batch: int, n_kv: int, group: int, dim: int, length: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_batch, n_kv, length, dim)).astype(np.float32)
    values = rng.standard_normal((n_batch, n_kv, length, dim)).astype(np.float32)
    queries = rng.standard_normal((n_batch, n_kv * group, length, dim)).astype(np.float32)
    return keys, values, queries


def check_call(
    helpers: Any,
    step: Any,
    ref: Any,
    ref_out: np.ndarray,
    stream_keys: np.ndarray,
    keys: np.ndarray,
    queries: np.ndarray,
    start: int,
    scale: float | None = None,
) -> None:
    """One engine call against the reference's matching `feed`."""
    n_batch, n_kv, length, dim = keys.shape
    n_q = queries.shape[1]
    assert step.keys.shape[:2] == (n_batch, n_kv) and step.keys.shape[3] == dim
    assert step.values.shape == step.keys.shape
    if length > 1:
        assert step.mask is not None, "a chunk of L > 1 needs a mask"
    if step.mask is not None:
        assert step.mask.shape[0] == n_batch and step.mask.shape[2:] == (length, step.keys.shape[2])
        assert step.mask.shape[1] in (1, n_q, n_kv)

    seen = helpers.visible_positions(step, stream_keys, n_q, length)
    for b in range(n_batch):
        for qh in range(n_q):
            expected = ref.last_visible[b][qh // (n_q // n_kv)]
            assert seen[b][qh] == expected, f"visible positions b={b} qh={qh}"

    out = helpers.step_outputs(step, queries, scale)
    np.testing.assert_allclose(out, ref_out, atol=ATOL, rtol=RTOL)
    check_state(helpers, step.state, ref, start + length)


def check_state(helpers: Any, state: Any, ref: Any, offset: int) -> None:
    """Retained positions per (b, h) and their rows, exactly the original keys and values."""
    n_batch, n_kv = len(ref.kept), ref.n_kv
    expected_positions = ref.positions()
    n_kept = len(expected_positions[0][0])
    assert state.n_kept == n_kept == state.tokens_kept
    assert state.offset == offset
    if not n_kept:
        return
    assert helpers.state_positions(state) == expected_positions
    positions = np.array(state.positions).astype(np.int64)
    stored_keys, stored_values = np.array(state.keys), np.array(state.values)
    for b in range(n_batch):
        for h in range(n_kv):
            _, ref_keys, ref_values = ref.kept_rows(b, h)
            order = np.argsort(positions[b, h])
            np.testing.assert_array_equal(stored_keys[b, h][order], ref_keys)
            np.testing.assert_array_equal(stored_values[b, h][order], ref_values)


def run_stream(
    helpers: Any,
    update: Callable[..., Any],
    state: Any,
    ref: Any,
    stream: tuple,
    chunks: list[int],
    *,
    give_queries: bool = True,
    scale: float | None = None,
    close_call: Callable[[bool], Any] = assume,
    after_call: Callable[[Any, Any], None] | None = None,
) -> Any:
    """Feed `stream` (keys, values, queries) in `chunks` to both; check after every call.

    Returns the engine's final state.
    """
    keys, values, queries = stream
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        k, v, q = keys[:, :, part], values[:, :, part], queries[:, :, part]
        step = update(
            state,
            mx.array(k),
            mx.array(v),
            queries=mx.array(q) if give_queries else None,
            scale=scale,
        )
        ref_out, _ = ref.feed(k, v, q, scale)
        close_call(ref.min_margin > MIN_MARGIN)
        check_call(helpers, step, ref, ref_out, keys, k, q, start, scale)
        if after_call is not None:
            after_call(step, ref)
        state = step.state
        start += size
    return state


def run_engine(update: Callable[..., Any], state: Any, stream: tuple, chunks: list[int], helpers):
    """Feed the stream in chunks; returns (final state, outputs [B, H_q, S, D] of every query)."""
    keys, values, queries = stream
    outputs, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        step = update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            queries=mx.array(queries[:, :, part]),
        )
        outputs.append(helpers.step_outputs(step, queries[:, :, part]))
        state = step.state
        start += size
    return state, np.concatenate(outputs, axis=2)


def assert_same_states(helpers: Any, a: Any, b: Any) -> None:
    assert a.offset == b.offset and a.n_kept == b.n_kept and a.tokens_seen == b.tokens_seen
    if a.n_kept:
        for got, want in zip(helpers.sorted_state(a), helpers.sorted_state(b), strict=True):
            np.testing.assert_array_equal(got, want)


def assert_clear(clear: bool) -> None:
    assert clear, "fixed stream has a near-tie decision: pick another seed"
