"""Velox for mlx-lm: drop-in KV-cache eviction caches (TOVA) with true queries via a hook."""

import mlx_lm.models.cache as _mlx_cache

from velox_mlx_lm.builder import KVCacheBuilder, KVCacheFactory
from velox_mlx_lm.cache import TOVAKVCache, VeloxKVCache
from velox_mlx_lm.config import METHODS, KVCacheConfig
from velox_mlx_lm.hook import install_attention_hook

# load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
_mlx_cache.TOVAKVCache = TOVAKVCache  # type: ignore[attr-defined]

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "TOVAKVCache",
    "VeloxKVCache",
    "install_attention_hook",
]
