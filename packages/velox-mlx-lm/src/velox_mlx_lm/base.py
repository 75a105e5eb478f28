"""The marker every Velox cache class derives from: the attention hook hands the attention
calls of these caches to their ``attend``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from velox_cache_core import Layer, QRows


class VeloxKVCache(_BaseCache):
    """Marker base: the attention hook hands attention calls for these caches to ``attend``."""

    @property
    def layer(self) -> Layer | None:
        """The core :class:`~velox_cache_core.Layer` a single-sequence cache drives; ``None``
        for a cache that drives several (a batch's rows)."""
        return None

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

    def size(self) -> int:
        raise NotImplementedError

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """Causal mask over ``retained + N`` (what the model sees without the hook, and what it
        shares between layers; the hook lets every layer build its own). A sliding window is
        refused: such layers keep mlx-lm's ``RotatingKVCache`` (``KVCacheBuilder.for_model``)."""
        if window_size is not None:
            raise ValueError(
                f"{self.serves or 'this model'}: {type(self).__name__} cannot serve a "
                f"sliding-window layer (window_size={window_size}); keep mlx-lm's "
                "RotatingKVCache there (KVCacheBuilder.for_model does)."
            )
        if N == 1:
            return None
        if not return_array:
            return "causal"
        n = self.size()
        return mx.arange(n + N)[None, :] <= (mx.arange(N) + n)[:, None]

    @property
    def serves(self) -> str | None:
        """The model type this cache serves, when the builder recorded it (for errors)."""
        return None


def additive(mask: Any) -> bool:
    """Whether a model's attention mask adds scores of its own (latent attention's RoPE part),
    rather than only saying which rows are visible (``None``, ``"causal"``, a bool array)."""
    return isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating)


def for_mlx(rows: Any) -> Any:
    """Rows as mlx-lm's attention takes them: quantized rows as its ``(packed, scales,
    biases)`` tuple (what ``QuantizedKVCache`` returns), full-precision ones unchanged."""
    return tuple(rows) if isinstance(rows, QRows) else rows


def fetched_as_is(fetched: Any, keys: Any, values: Any, mask: Any) -> bool:
    """Whether the model attends over exactly what ``update_and_fetch`` returned (``fetched``)
    under a mask that only says which rows are visible."""
    if keys is None:
        return True
    return (
        fetched is not None and keys is fetched[0] and values is fetched[1] and not additive(mask)
    )
