"""Test support shared by the core tests: random streams and hypothesis strategies for them, numpy
views of engine results (steps and states), and a driver that feeds an engine policy and its
numpy reference (core_reference*.py) the same stream and compares them after every call.

Imported by name (``import core_harness``): conftest.py puts this directory on ``sys.path``. The
``core_`` prefix keeps the name unique among all the test directories run in one pytest process.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from velox_cache_core.store.rows import dense

# Decisions closer than this (relative score gap) could flip under fp32 rounding: skip them.
MIN_MARGIN = 1e-4
ATOL = RTOL = 2e-4


# ----------------------------------------------------------------------------------- streams


@st.composite
def chunk_sizes(draw: st.DrawFn, max_total: int = 24) -> list[int]:
    """Chunk lengths (0 allowed) adding up to at most `max_total`."""
    sizes = draw(st.lists(st.integers(0, 8), max_size=7))
    kept, total = [], 0
    for size in sizes:
        size = min(size, max_total - total)
        kept.append(size)
        total += size
    return kept


@st.composite
def two_splits(draw: st.DrawFn, max_length: int = 24) -> tuple[int, list[int], list[int]]:
    """(length, chunks, other chunks): two ways to cut the same stream."""
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
    """Random float32 (keys, values [B, H_kv, S, D], queries [B, H_kv * group, S, D])."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_batch, n_kv, length, dim)).astype(np.float32)
    values = rng.standard_normal((n_batch, n_kv, length, dim)).astype(np.float32)
    queries = rng.standard_normal((n_batch, n_kv * group, length, dim)).astype(np.float32)
    return keys, values, queries


# ------------------------------------------------------------------------- numpy views


def mask_rows(step: Any, n_q: int) -> np.ndarray | None:
    """step.mask expanded to one row per query head: bool [B, H_q, L, n], or None.

    The mask's head axis is 1 (whole layer), H_q, or H_kv (repeated over each query group).
    """
    if step.mask is None:
        return None
    mask = np.array(step.mask)
    assert mask.dtype == np.bool_, f"mask dtype {mask.dtype}, expected bool"
    n_kv = step.keys.shape[1]
    heads = mask.shape[1]
    if heads == n_q:
        return mask
    if heads == 1:
        return np.repeat(mask, n_q, axis=1)
    assert heads == n_kv, f"mask heads {heads}: expected 1, H_q={n_q} or H_kv={n_kv}"
    return np.repeat(mask, n_q // n_kv, axis=1)


def step_outputs(step: Any, queries: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Attention output [B, H_q, L, D] of `queries` over step.keys/values under step.mask."""
    keys = np.array(dense(step.keys)).astype(np.float64)
    values = np.array(dense(step.values)).astype(np.float64)
    queries = np.asarray(queries, dtype=np.float64)
    n_batch, n_q, length, dim = queries.shape
    group = n_q // keys.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    mask = mask_rows(step, n_q)
    if length == 0:
        return np.zeros((n_batch, n_q, length, values.shape[-1]))
    keys = np.repeat(keys, group, axis=1)  # one KV row per query head
    values = np.repeat(values, group, axis=1)
    logits = np.einsum("bqld,bqnd->bqln", queries, keys) * scale
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("bqln,bqnd->bqld", probs, values)


def identify_rows(rows: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Position of each row of `rows` [B, H, n, D] in `stream` [B, H, S, D] (-1: not found).

    Rows are matched by exact equality: the engine copies keys, it never recomputes them.
    """
    equal = (rows[:, :, :, None, :] == stream[:, :, None, :, :]).all(axis=-1)  # [B, H, n, S]
    if equal.size == 0:
        return np.full(rows.shape[:3], -1, dtype=np.int64)
    return np.where(equal.any(axis=-1), equal.argmax(axis=-1), -1).astype(np.int64)


def visible_positions(step: Any, stream_keys: np.ndarray, n_q: int, length: int) -> list:
    """[b][qh][i] -> sorted positions query i of head qh may attend to, from step.mask."""
    keys = np.array(dense(step.keys))
    n_batch, n_kv, n_rows, _ = keys.shape
    group = n_q // n_kv
    row_positions = identify_rows(keys, stream_keys)
    mask = mask_rows(step, n_q)
    assert mask is None or mask.shape[2] == length, f"mask has {mask.shape[2]} query rows"
    result = []
    for b in range(n_batch):
        per_head = []
        for qh in range(n_q):
            h = qh // group
            if mask is None:
                allowed = [[True] * n_rows for _ in range(length)]
            else:
                allowed = [list(mask[b, qh, i]) for i in range(length)]
            per_query = []
            for row in allowed:
                seen = [int(row_positions[b, h, r]) for r in range(n_rows) if row[r]]
                assert -1 not in seen, "a visible returned key matches no fed key"
                per_query.append(sorted(seen))
            per_head.append(per_query)
        result.append(per_head)
    return result


def state_positions(state: Any) -> list[list[list[int]]] | None:
    """Retained positions [b][h] as sorted lists, or None when nothing is stored yet."""
    if state.positions is None or state.n_kept == 0:
        return None
    positions = np.array(state.positions)
    return [[sorted(int(p) for p in row) for row in rows_b] for rows_b in positions]


def sorted_state(state: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, keys, values) of a state with every (b, h) row sorted by position."""
    positions = np.array(state.positions).astype(np.int64)
    order = np.argsort(positions, axis=-1, kind="stable")
    keys = np.take_along_axis(np.array(state.keys), order[..., None], axis=2)
    values = np.take_along_axis(np.array(state.values), order[..., None], axis=2)
    return np.take_along_axis(positions, order, axis=-1), keys, values


def assert_same_states(a: Any, b: Any) -> None:
    """Same offset, counts, and retained (position, key, value) rows, bit for bit."""
    assert a.offset == b.offset and a.n_kept == b.n_kept and a.tokens_seen == b.tokens_seen
    if a.n_kept:
        for got, want in zip(sorted_state(a), sorted_state(b), strict=True):
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- engine against reference


def check_call(
    step: Any,
    ref: Any,
    ref_out: np.ndarray,
    stream_keys: np.ndarray,
    keys: np.ndarray,
    queries: np.ndarray,
    start: int,
    scale: float | None = None,
) -> None:
    """One engine call against the reference's matching `feed`: shapes, what every query sees,
    outputs to fp32 tolerance, and the state afterwards."""
    n_batch, n_kv, length, dim = keys.shape
    n_q = queries.shape[1]
    assert step.keys.shape[:2] == (n_batch, n_kv) and step.keys.shape[3] == dim
    assert step.values.shape == step.keys.shape
    if length > 1:
        assert step.mask is not None, "a chunk of L > 1 needs a mask"
    if step.mask is not None:
        assert step.mask.shape[0] == n_batch and step.mask.shape[2:] == (length, step.keys.shape[2])
        assert step.mask.shape[1] in (1, n_q, n_kv)

    seen = visible_positions(step, stream_keys, n_q, length)
    for b in range(n_batch):
        for qh in range(n_q):
            expected = ref.last_visible[b][qh // (n_q // n_kv)]
            assert seen[b][qh] == expected, f"visible positions b={b} qh={qh}"

    out = step_outputs(step, queries, scale)
    np.testing.assert_allclose(out, ref_out, atol=ATOL, rtol=RTOL)
    check_state(step.state, ref, start + length)


def check_state(state: Any, ref: Any, offset: int) -> None:
    """Retained positions per (b, h) and their rows, exactly the original keys and values."""
    n_batch, n_kv = len(ref.kept), len(ref.kept[0])
    expected_positions = ref.positions()
    n_kept = len(expected_positions[0][0])
    assert state.n_kept == n_kept == state.tokens_kept
    assert state.offset == offset
    if not n_kept:
        return
    assert state_positions(state) == expected_positions
    positions = np.array(state.positions).astype(np.int64)
    stored_keys, stored_values = np.array(state.keys), np.array(state.values)
    for b in range(n_batch):
        for h in range(n_kv):
            _, ref_keys, ref_values = ref.kept_rows(b, h)
            order = np.argsort(positions[b, h])
            np.testing.assert_array_equal(stored_keys[b, h][order], ref_keys)
            np.testing.assert_array_equal(stored_values[b, h][order], ref_values)


def run_stream(
    update: Callable[..., Any],
    state: Any,
    ref: Any,
    stream: tuple,
    chunks: list[int],
    *,
    start: int = 0,
    give_queries: bool = True,
    scale: float | None = None,
    close_call: Callable[[bool], Any] = assume,
    after_call: Callable[[Any, Any, Any], None] | None = None,
) -> Any:
    """Feed `stream` (keys, values, queries) from `start` in `chunks` to both; check every call.

    `after_call(step, ref, state)` adds checks (`state`: the call's input state). Returns the
    engine's final state.
    """
    keys, values, queries = stream
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
        check_call(step, ref, ref_out, keys, k, q, start, scale)
        if after_call is not None:
            after_call(step, ref, state)
        state = step.state
        start += size
    return state


def run_engine(
    update: Callable[..., Any],
    state: Any,
    stream: tuple,
    chunks: list[int],
    give_queries: bool = True,
) -> tuple[Any, np.ndarray]:
    """Feed the stream in chunks; returns (final state, outputs [B, H_q, S, D] of every query)."""
    keys, values, queries = stream
    outputs, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        step = update(
            state,
            mx.array(keys[:, :, part]),
            mx.array(values[:, :, part]),
            queries=mx.array(queries[:, :, part]) if give_queries else None,
        )
        outputs.append(step_outputs(step, queries[:, :, part]))
        state = step.state
        start += size
    return state, np.concatenate(outputs, axis=2)


def run_reference(ref: Any, stream: tuple, chunks: list[int]) -> np.ndarray:
    """Feed the stream to a reference in chunks; returns the outputs of every query."""
    keys, values, queries = stream
    outputs, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        out, _ = ref.feed(keys[:, :, part], values[:, :, part], queries[:, :, part])
        outputs.append(out)
        start += size
    return np.concatenate(outputs, axis=2)


def assert_clear(clear: bool) -> None:
    """close_call for fixed streams: a near tie is a bad seed, not a reason to skip."""
    assert clear, "fixed stream has a near-tie decision: pick another seed"
