"""Attention of a call's queries over what a policy's step says they see."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from velox_cache_core import lanes
from velox_cache_core.engine import Step
from velox_cache_core.scoring import grouped_logits, softmax
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.rows import QUANTIZED, dense
from velox_cache_core.store.token_rows import QRows


def attend(queries: mx.array, step: Step, scale: float, sinks: mx.array | None = None) -> mx.array:
    """``queries [B, H_q, L, D]`` over ``step.keys``/``step.values`` ``[B, H_kv, n, D]`` with
    ``step.mask`` (repeated over each query group when given per KV head): ``[B, H_q, L, D]``.

    Attend once: when the rule already computed the query's attention weights (a decode step
    scored with the true query) and the backend is the CPU, where MLX's attention is not a fused
    kernel, the output is those weights times the values. On Metal/CUDA the fused kernel runs.
    Quantized rows (:class:`~velox_cache_core.store.token_rows.QRows`) have no fused kernel:
    they are read packed by ``mx.quantized_matmul`` on every backend (the rule's weights times
    the values, or scores, mask, softmax and values, as mlx-lm's quantized attention computes them).
    ``sinks``: per-head attention sink logits ``[H_q]`` of models that have them (gpt-oss).
    A step with :attr:`~velox_cache_core.engine.Step.lanes` (heads keeping different row
    counts) attends over them and the step's rows together
    (:func:`velox_cache_core.lanes.attend_weights`).
    """
    if step.out is not None:  # the decision attended already (a step over evicting lanes)
        return step.out
    if step.lanes is not None:  # heads with different row counts: lanes plus the tail
        return lanes.attend_weights(
            queries, step.lanes, step.keys, step.values, step.mask, scale, sinks
        )[0]
    quantized = isinstance(step.values, QRows)
    if step.probs is not None and sinks is None and (quantized or mx.default_device() == mx.cpu):
        return weights_times_values(step.probs, step.values, queries.dtype)
    mask = step.mask
    if _row_on_cpu(queries, step, sinks):
        keys, values = step.keys, step.values
        if keys.shape[2] < 2:  # a shapeless trace is unsafe at one row (see compiled_row)
            return attend_row(queries, keys, values, scale)  # type: ignore[arg-type]
        return compiled_row(queries, keys, values, scale)(queries, keys, values)  # type: ignore[arg-type]
    if mask is not None and mask.shape[1] not in (1, queries.shape[1]):
        mask = mx.repeat(mask, queries.shape[1] // mask.shape[1], axis=1)
    if isinstance(step.keys, QUANTIZED) and isinstance(step.values, QRows) and sinks is None:
        return _quantized(queries, step.keys, step.values, scale, mask)
    return mx.fast.scaled_dot_product_attention(
        queries, dense(step.keys), dense(step.values), scale=scale, mask=mask, sinks=sinks
    )


def _row_on_cpu(queries: mx.array, step: Step, sinks: mx.array | None) -> bool:
    """One query row over full-precision rows, unmasked, no sinks, on the CPU backend."""
    if step.mask is not None or sinks is not None or queries.shape[2] != 1:
        return False
    dense_rows = isinstance(step.keys, mx.array) and isinstance(step.values, mx.array)
    return dense_rows and mx.default_device() == mx.cpu


def attend_row(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """One query row ``[B, H_q, 1, D]`` over every row of ``keys``/``values``
    ``[B, H_kv, n, D]``, unmasked: ``[B, H_q, 1, D]``.

    How a decode step attends on the CPU, where MLX's attention is not a fused kernel either:
    the scores as the eviction rules compute them (:func:`velox_cache_core.scoring.
    grouped_logits`), their softmax, times the values. The decode fast path computes the same
    inside its compiled step (fewer ops to dispatch than the attention's own), so both paths
    agree bit for bit; against MLX's attention the last bits differ."""
    probs = softmax(grouped_logits(queries, keys, scale, "head"))
    return weights_times_values(probs, values, queries.dtype)


_ROWS: dict[tuple[Any, ...], Callable[[mx.array, mx.array, mx.array], mx.array]] = {}


def compiled_row(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float
) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """:func:`attend_row` compiled once per (batch, heads, widths, dtypes, scale) and
    ``shapeless``: one call, whatever the number of rows ``n`` (a store that grows by a row per
    step, as SnapKV's after its cut, would retrace a plain compiled function every step). The
    same function, so the same bits (``tests/test_attention_row.py``); none of its shapes but
    the arrays' own depend on ``n``. Only for ``n >= 2``: a shapeless trace treats a
    dimension of size 1 as broadcastable, and replaying one across ``n = 1`` and ``n > 1``
    (either way) corrupts memory (MLX 0.32, measured)."""
    B, H_q, _, D = queries.shape
    H_kv, D_v = keys.shape[1], values.shape[3]
    key = (B, H_q, H_kv, D, D_v, queries.dtype, keys.dtype, values.dtype, scale)
    found = _ROWS.get(key)
    if found is None:
        row = functools.partial(attend_row, scale=scale)
        found = _ROWS[key] = mx.compile(row, shapeless=True)
    return found


def weights_times_values(
    probs: mx.array, values: mx.array | QRows | KRows, dtype: mx.Dtype
) -> mx.array:
    """One query row's attention weights (``[B, H_q, 1, n]``, or grouped per KV head
    ``[B, H_kv, G, 1, n]``) times each KV head's ``values [B, H_kv, n, D]``: the attention
    output ``[B, H_q, 1, D]`` in ``dtype`` (the queries'). The row count ``n`` is left for the
    reshape to infer, so a ``shapeless`` trace of this (:func:`compiled_row`) fits every ``n``."""
    B, H_kv, _, D = values.shape
    group = math.prod(probs.shape[1:-2]) // H_kv  # the query heads per KV head
    weights = probs.reshape(B, H_kv, group, 1, -1).astype(values.dtype)
    return times_values(weights, values).reshape(B, -1, 1, D).astype(dtype)


def times_values(probs: mx.array, values: mx.array | QRows | KRows) -> mx.array:
    """``probs [B, H_kv, G, L, n]`` times each KV head's values: ``[B, H_kv, G, L, D]``."""
    if isinstance(values, QUANTIZED):
        return values.matmul(probs, transpose=False)
    return probs @ values[:, :, None]


def grouped_mask(mask: mx.array, H_q: int, H_kv: int) -> mx.array:
    """A bool mask ``[B, H, L, n]`` (``H`` = 1, ``H_kv`` or ``H_q``) grouped as per-KV-head
    logits are (:func:`velox_cache_core.scoring.grouped_logits`): ``[B, H_kv or 1, H_q / H_kv
    or 1, L, n]``."""
    B, H, L, n = (int(s) for s in mask.shape)
    if H_q == H and H_q != H_kv:
        return mask.reshape(B, H_kv, H_q // H_kv, L, n)
    return mask.reshape(B, H, 1, L, n)


def _quantized(
    queries: mx.array, keys: QRows | KRows, values: QRows, scale: float, mask: mx.array | None
) -> mx.array:
    """Attention over quantized rows with a bool ``mask [B, 1 or H_q, L, n]`` (or none)."""
    B, H_q, L, D = queries.shape
    H_kv = keys.shape[1]
    q = (queries * scale).astype(keys.dtype).reshape(B, H_kv, H_q // H_kv, L, D)
    scores = keys.matmul(q, transpose=True)  # [B, H_kv, G, L, n]
    if mask is not None:
        scores = mx.where(grouped_mask(mask, H_q, H_kv), scores, mx.finfo(scores.dtype).min)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = times_values(probs, values)
    return out.reshape(B, H_q, L, int(values.shape[3])).astype(queries.dtype)
