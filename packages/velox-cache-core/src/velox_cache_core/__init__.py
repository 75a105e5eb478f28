"""Framework-neutral MLX KV-cache eviction primitives."""

from velox_cache_core.engine import Call, Decision, Step
from velox_cache_core.policies import POLICIES, Policy, register
from velox_cache_core.policies.expected_attention import (
    ExpectedAttentionState,
    expected_attention_compress,
    expected_attention_update,
    expected_scores,
    init_expected_attention_state,
)
from velox_cache_core.policies.h2o import H2OState, h2o_update, init_h2o_state
from velox_cache_core.policies.morphkv import MorphKVState, init_morphkv_state, morphkv_update
from velox_cache_core.policies.snapkv import (
    SnapKVState,
    init_snapkv_state,
    snapkv_compress,
    snapkv_update,
)
from velox_cache_core.policies.streaming_llm import (
    StreamingLLMState,
    init_streaming_llm_state,
    streaming_llm_update,
)
from velox_cache_core.policies.tova import (
    PRESETS,
    TovaState,
    TovaStep,
    init_tova_state,
    tova_update,
)
from velox_cache_core.registry import policy_for_method, unregister
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState, running

__version__ = "0.6.0"

__all__ = [
    "POLICIES",
    "PRESETS",
    "Call",
    "Decision",
    "ExpectedAttentionState",
    "H2OState",
    "KVSlots",
    "MorphKVState",
    "Policy",
    "PolicyState",
    "SnapKVState",
    "Step",
    "StreamingLLMState",
    "TovaState",
    "TovaStep",
    "expected_attention_compress",
    "expected_attention_update",
    "expected_scores",
    "h2o_update",
    "init_expected_attention_state",
    "init_h2o_state",
    "init_morphkv_state",
    "init_snapkv_state",
    "init_streaming_llm_state",
    "init_tova_state",
    "morphkv_update",
    "policy_for_method",
    "register",
    "running",
    "snapkv_compress",
    "snapkv_update",
    "streaming_llm_update",
    "tova_update",
    "unregister",
]
