"""Layer-wide decisions under tensor parallelism (``mx.distributed``).

A tensor-parallel model (mlx-lm's ``model.shard(group)``) splits every attention layer's query
and KV heads over the ranks of ``group``: each rank's cache sees ``H_q / N`` query and
``H_kv / N`` KV heads. A decision per KV head (scope ``head``) only reads that head's own query
heads, which live on the same rank, so it needs no communication. A layer-wide decision (scope
``layer``: TOVA's ``tova`` preset, MorphKV, H2O with ``scope='layer'``) averages the weights of
*every* query head of the layer: each rank sums its local heads' weights per candidate, the sums
are ``all_sum``-ed over the group and divided by the global head count, so every rank holds the
unsharded model's weights and takes the same decision (ties go to the oldest position, so equal
weights give equal choices).

The group reaches the rules on :class:`velox_cache_core.engine.Call` (``update(..., group=)``);
without one, or with a group of one rank, nothing is communicated and the arithmetic is the
single-process one, bit for bit.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def layer_group(group: Any, scope: str) -> Any:
    """The group a decision's head average spans: ``group`` for scope ``layer`` over two or
    more ranks, else ``None`` (rank-local)."""
    if group is None or scope != "layer" or group.size() == 1:
        return None
    return group


def head_mean(x: mx.array, axis: int, group: Any = None) -> mx.array:
    """Mean of ``x`` over its head ``axis``, over the heads of every rank of ``group``.

    Without a group this is ``x.mean(axis)``. With one, the local sum is ``all_sum``-ed and
    divided by ``heads_here * group.size()``: exact because ``model.shard`` splits the heads
    evenly (it divides ``n_heads`` by the group size).
    """
    if group is None:
        return x.mean(axis=axis)
    total = x.shape[axis] * group.size()
    return mx.distributed.all_sum(x.sum(axis=axis), group=group) / total
