"""numpy views of engine results (TovaStep / TovaState) for comparison with the reference."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def as_numpy(x: Any) -> np.ndarray:
    return np.array(x)


def mask_rows(step: Any, n_q: int) -> np.ndarray | None:
    """step.mask expanded to one row per query head: bool [B, H_q, L, n], or None.

    The mask's head axis is 1 (whole layer), H_q, or H_kv (repeated over each query group).
    """
    if step.mask is None:
        return None
    mask = as_numpy(step.mask)
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
    keys = as_numpy(step.keys).astype(np.float64)
    values = as_numpy(step.values).astype(np.float64)
    queries = np.asarray(queries, dtype=np.float64)
    n_batch, n_q, length, dim = queries.shape
    group = n_q // keys.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    mask = mask_rows(step, n_q)
    outputs = np.zeros((n_batch, n_q, length, values.shape[-1]))
    if length == 0:
        return outputs
    for b in range(n_batch):
        for qh in range(n_q):
            h = qh // group
            logits = queries[b, qh] @ keys[b, h].T * scale  # [L, n]
            if mask is not None:
                logits = np.where(mask[b, qh], logits, -np.inf)
            logits = logits - logits.max(axis=-1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=-1, keepdims=True)
            outputs[b, qh] = probs @ values[b, h]
    return outputs


def identify_rows(rows: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Position of each row of `rows` [B, H, n, D] in `stream` [B, H, S, D] (-1: not found).

    Rows are matched by exact equality: the engine copies keys, it never recomputes them.
    """
    n_batch, n_heads, n_rows, _ = rows.shape
    found = np.full((n_batch, n_heads, n_rows), -1, dtype=np.int64)
    for b in range(n_batch):
        for h in range(n_heads):
            for r in range(n_rows):
                hits = np.nonzero((stream[b, h] == rows[b, h, r]).all(axis=-1))[0]
                if len(hits):
                    found[b, h, r] = hits[0]
    return found


def visible_positions(step: Any, stream_keys: np.ndarray, n_q: int, length: int) -> list:
    """[b][qh][i] -> sorted positions query i of head qh may attend to, from step.mask."""
    keys = as_numpy(step.keys)
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
    positions = as_numpy(state.positions)
    return [[sorted(int(p) for p in row) for row in rows_b] for rows_b in positions]


def sorted_state(state: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, keys, values) of a state with every (b, h) row sorted by position."""
    positions = as_numpy(state.positions).astype(np.int64)
    order = np.argsort(positions, axis=-1, kind="stable")
    keys = np.take_along_axis(as_numpy(state.keys), order[..., None], axis=2)
    values = np.take_along_axis(as_numpy(state.values), order[..., None], axis=2)
    return np.take_along_axis(positions, order, axis=-1), keys, values
