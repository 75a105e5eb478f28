"""Velox for mlx-lm: drop-in fixed-budget KV caches (TOVA and siblings), true queries via a hook."""

import os as _os

if _os.environ.get("VELOX_BLAS") != "default":
    # Linux: load OpenBLAS before mlx is first imported (MLX's CPU wheel links the ~20x slower
    # reference BLAS). A no-op when mlx is already imported, off Linux, or without OpenBLAS;
    # VELOX_BLAS=default opts out. velox_mlx_lm.blas.blas_in_use() says what happened.
    from velox_mlx_lm.blas import preload_openblas as _preload_openblas

    _preload_openblas()

import mlx_lm.models.cache as _mlx_cache

from velox_mlx_lm.builder import CACHE_CLASSES, KVCacheBuilder, KVCacheFactory
from velox_mlx_lm.cache import (
    H2OKVCache,
    MorphKVCache,
    PolicyKVCache,
    SnapKVCache,
    StreamingLLMKVCache,
    TOVAKVCache,
    VeloxKVCache,
)
from velox_mlx_lm.config import METHODS, KVCacheConfig
from velox_mlx_lm.hook import install_attention_hook
from velox_mlx_lm.prompt_cache import load_prompt_cache

# mlx-lm's load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
for _cls in CACHE_CLASSES.values():
    setattr(_mlx_cache, _cls.__name__, _cls)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "H2OKVCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "MorphKVCache",
    "PolicyKVCache",
    "SnapKVCache",
    "StreamingLLMKVCache",
    "TOVAKVCache",
    "VeloxKVCache",
    "install_attention_hook",
    "load_prompt_cache",
]
