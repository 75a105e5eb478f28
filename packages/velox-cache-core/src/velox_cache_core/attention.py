"""Attention of a call's queries over what a policy's step says they see."""

from __future__ import annotations

import mlx.core as mx

from velox_cache_core.engine import Step
from velox_cache_core.rows import QRows, dense


def attend(queries: mx.array, step: Step, scale: float, sinks: mx.array | None = None) -> mx.array:
    """``queries [B, H_q, L, D]`` over ``step.keys``/``step.values`` ``[B, H_kv, n, D]`` with
    ``step.mask`` (repeated over each query group when given per KV head): ``[B, H_q, L, D]``.

    Attend once: when the rule already computed the query's attention weights (a decode step
    scored with the true query) and the backend is the CPU, where MLX's attention is not a fused
    kernel, the output is those weights times the values. On Metal/CUDA the fused kernel runs.
    ``sinks``: per-head attention sink logits ``[H_q]`` of models that have them (gpt-oss).
    """
    quantized = isinstance(step.values, QRows)
    if step.probs is not None and sinks is None and (quantized or mx.default_device() == mx.cpu):
        # Quantized rows have no fused kernel: their weights are these on every backend.
        B, H_kv, n, D = step.values.shape
        probs = step.probs.reshape(B, H_kv, -1, 1, n).astype(step.values.dtype)
        out = probs @ dense(step.values)[:, :, None]  # [B, H_kv, H_q / H_kv, 1, D]
        return out.reshape(B, -1, 1, D).astype(queries.dtype)
    mask = step.mask
    if mask is not None and mask.shape[1] not in (1, queries.shape[1]):
        mask = mx.repeat(mask, queries.shape[1] // mask.shape[1], axis=1)
    return mx.fast.scaled_dot_product_attention(
        queries, dense(step.keys), dense(step.values), scale=scale, mask=mask, sinks=sinks
    )
