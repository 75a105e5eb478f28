"""The marker every Velox cache class derives from: the attention hook hands the attention
calls of these caches to their ``attend``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


class VeloxKVCache(_BaseCache):
    """Marker base: the attention hook hands attention calls for these caches to ``attend``."""

    def attend(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
        keys: mx.array | None = None,
        values: mx.array | None = None,
    ) -> mx.array:
        """The attention call the model made with this cache: ``keys``/``values`` are what it
        passed (``None``: what ``update_and_fetch`` returned), ``mask`` its own."""
        raise NotImplementedError


def additive(mask: Any) -> bool:
    """Whether a model's attention mask adds scores of its own (latent attention's RoPE part),
    rather than only saying which rows are visible (``None``, ``"causal"``, a bool array)."""
    return isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating)


def fetched_as_is(fetched: Any, keys: Any, values: Any, mask: Any) -> bool:
    """Whether the model attends over exactly what ``update_and_fetch`` returned (``fetched``)
    under a mask that only says which rows are visible."""
    if keys is None:
        return True
    return (
        fetched is not None and keys is fetched[0] and values is fetched[1] and not additive(mask)
    )
