"""Velox caches on sharded models (``mx.distributed``; see ``docs/distributed.md``).

- Tensor parallel (``model.shard(group)``, ``mlx_lm.utils.sharded_load``): each rank's cache
  holds its share of the heads. :func:`tensor_group` finds the group in the model's sharded
  attention projections; ``KVCacheBuilder.for_model`` gives it to every Velox cache, whose
  layer-wide decisions then ``all_sum`` the heads' weights over it
  (``velox_cache_core.distributed``), so every rank keeps the unsharded model's tokens.
- Pipeline parallel (``model.model.pipeline(group)``): each rank holds whole layers and its own
  caches; nothing is communicated for eviction. The caches accept the models'
  ``cache[-1].keys = mx.depends(...)`` (``PolicyKVCache.keys``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_ATTENTION_NAMES = ("attn", "attention")


def _sharded_layer_types() -> tuple[type, ...]:
    try:
        from mlx.nn.layers import distributed as d
    except ImportError:  # an MLX without the sharded layers: nothing can be sharded
        return ()
    names = (
        "AllToShardedLinear",
        "ShardedToAllLinear",
        "QuantizedAllToShardedLinear",
        "QuantizedShardedToAllLinear",
    )
    return tuple(getattr(d, name) for name in names if hasattr(d, name))


def tensor_group(model: nn.Module) -> Any:
    """The tensor-parallel group the model's attention heads are split over (``None`` if the
    attention is not sharded, or the group has one rank).

    Looks for MLX's sharded linear layers (``shard_linear``, what mlx-lm's ``model.shard``
    uses) inside each layer's attention module (a submodule whose name contains ``attn`` or
    ``attention``).
    """
    types = _sharded_layer_types()
    if not types:
        return None
    for layer in getattr(model, "layers", []):
        if layer is None or not isinstance(layer, nn.Module):
            continue
        for name, module in layer.named_modules():
            if isinstance(module, types) and any(a in name.lower() for a in _ATTENTION_NAMES):
                group = getattr(module, "group", None)
                if group is not None and group.size() > 1:
                    return group
    return None


def world() -> Any:
    """``mx.distributed.init()`` when this process runs under ``mlx.launch`` with two or more
    ranks, else ``None`` (a single process: nothing to shard)."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def shard_model(model: nn.Module, group: Any, pipeline: bool = False) -> nn.Module:
    """Shard ``model`` over ``group``: tensor parallel (``model.shard``) when the architecture
    has it and ``pipeline`` is false, else pipeline parallel (``model.model.pipeline``).
    ``ValueError`` when the architecture has neither (or not the one ``pipeline`` asks for), or
    its heads do not split evenly over the ranks."""
    inner = getattr(model, "model", None)
    can_pipeline = inner is not None and hasattr(inner, "pipeline")
    if pipeline and not can_pipeline:
        raise ValueError(f"{type(model).__module__} does not support pipeline parallelism")
    if hasattr(model, "shard") and not pipeline:
        n = group.size()
        for layer in getattr(model, "layers", []):
            attn = getattr(layer, "self_attn", None)
            for field in ("n_heads", "n_kv_heads"):
                heads = getattr(attn, field, None)
                if isinstance(heads, int) and heads % n:
                    raise ValueError(
                        f"cannot shard the model over {n} ranks: {field}={heads} is not a "
                        f"multiple of {n}"
                    )
        model.shard(group)
        return model
    if can_pipeline:
        inner.pipeline(group)  # type: ignore[union-attr]
        return model
    raise ValueError(f"{type(model).__module__} supports neither tensor nor pipeline parallelism")
