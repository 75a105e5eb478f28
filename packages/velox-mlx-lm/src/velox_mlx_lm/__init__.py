"""Velox for mlx-lm: drop-in fixed-budget KV caches (TOVA and siblings), true queries via a hook."""

import os as _os

if _os.environ.get("VELOX_BLAS") != "default":
    # Linux: load OpenBLAS before mlx is first imported (MLX's CPU wheel links the ~20x slower
    # reference BLAS). A no-op when mlx is already imported, off Linux, or without OpenBLAS;
    # VELOX_BLAS=default opts out. velox_blas.blas_in_use() says what happened. velox_blas is a
    # top-level package of this distribution that imports no mlx (code can import it first).
    from velox_blas import preload_openblas as _preload_openblas

    _preload_openblas()

# Defining the cache classes registers them by name in mlx_lm.models.cache, where mlx-lm's
# load_prompt_cache looks classes up (velox_mlx_lm.cache.PolicyKVCache.__init_subclass__).
import velox_mlx_lm.flags  # noqa: F401  (reserves the commands' flags in the registry)
from velox_mlx_lm.base import VeloxKVCache
from velox_mlx_lm.builder import KVCacheBuilder, KVCacheFactory
from velox_mlx_lm.cache import (
    H2OKVCache,
    MorphKVCache,
    PolicyKVCache,
    SnapKVCache,
    StreamingLLMKVCache,
    TOVAKVCache,
    cache_class,
)
from velox_mlx_lm.config import KVCacheConfig, methods
from velox_mlx_lm.hook import install_attention_hook
from velox_mlx_lm.prompt_cache import load_prompt_cache

__version__ = "0.12.0"

__all__ = [
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
    "cache_class",
    "install_attention_hook",
    "load_prompt_cache",
    "methods",
]
