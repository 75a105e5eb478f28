"""One module per eviction policy; each registers its ``Policy`` record here (one line each)."""

from __future__ import annotations

from velox_cache_core.policies.expected_attention import (
    EXPECTED_ATTENTION,
    expected_attention_compress,
)
from velox_cache_core.policies.h2o import H2O
from velox_cache_core.policies.kvzip import KVZIP, kvzip_compress
from velox_cache_core.policies.morphkv import MORPHKV
from velox_cache_core.policies.snapkv import SNAPKV, snapkv_compress
from velox_cache_core.policies.streaming_llm import STREAMING_LLM
from velox_cache_core.policies.tova import TOVA
from velox_cache_core.policy import Policy
from velox_cache_core.registry import POLICIES, register

register(TOVA)
register(H2O)
register(STREAMING_LLM)
register(SNAPKV)
register(MORPHKV)
register(KVZIP)
register(EXPECTED_ATTENTION)

__all__ = [
    "POLICIES",
    "Policy",
    "expected_attention_compress",
    "kvzip_compress",
    "register",
    "snapkv_compress",
]
