"""The marker every Velox cache class derives from: the attention hook hands the attention
calls of these caches to their ``attend``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


class VeloxKVCache(_BaseCache):
    """Marker base: the attention hook hands attention calls for these caches to ``attend``."""

    def attend(
        self, queries: mx.array, scale: float, mask: Any, sinks: mx.array | None
    ) -> mx.array:
        raise NotImplementedError
