"""The attention hook: lets a Velox cache see the true queries and apply its own masks.

mlx-lm models import ``scaled_dot_product_attention`` by name from ``mlx_lm.models.base`` and
call it as ``scaled_dot_product_attention(q, k, v, cache=..., scale=..., mask=...)``. We replace
that global in the module of every attention class of the model with a wrapper that hands the
call to the cache when it is a Velox cache and otherwise calls the original unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from velox_mlx_lm.base import VeloxKVCache

_NAME = "scaled_dot_product_attention"
_original = base.scaled_dot_product_attention


def velox_scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``."""
    if isinstance(cache, VeloxKVCache):
        return cache.attend(queries, scale=scale, mask=mask, sinks=sinks, keys=keys, values=values)
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_attention_hook(model: nn.Module) -> int:
    """Route the model's attention calls through the hook; idempotent.

    Returns how many of the model's source modules call attention through the hook (0 means
    the model computes attention by hand, e.g. gemma2 or olmo: a Velox cache then only sees
    keys and values).
    """
    reached: set[str] = set()
    for _, module in model.named_modules():
        call = getattr(type(module), "__call__", None)  # noqa: B004 (want the function)
        module_globals = getattr(call, "__globals__", None)
        if not module_globals or _NAME not in module_globals:
            continue
        current = module_globals[_NAME]
        if current is _original:
            module_globals[_NAME] = velox_scaled_dot_product_attention
            current = velox_scaled_dot_product_attention
        if current is velox_scaled_dot_product_attention:
            reached.add(module_globals["__name__"])
    return len(reached)
