"""One module per eviction policy; each registers its ``Policy`` record here, in this order
(the order ``POLICIES`` and ``--method`` list them in)."""

from __future__ import annotations

from velox_cache_core.policies.expected_attention import EXPECTED_ATTENTION
from velox_cache_core.policies.h2o import H2O
from velox_cache_core.policies.kvzip import KVZIP
from velox_cache_core.policies.morphkv import MORPHKV
from velox_cache_core.policies.snapkv import SNAPKV
from velox_cache_core.policies.streaming_llm import STREAMING_LLM
from velox_cache_core.policies.tova import TOVA
from velox_cache_core.registry import register

for _policy in (TOVA, H2O, STREAMING_LLM, SNAPKV, MORPHKV, KVZIP, EXPECTED_ATTENTION):
    register(_policy)
