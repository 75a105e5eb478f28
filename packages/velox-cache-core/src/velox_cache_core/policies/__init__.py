"""One module per eviction policy, and a registry so integrations can treat them alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from velox_cache_core.policies.tova import TovaState, init_tova_state, tova_update


@dataclass(frozen=True)
class Policy:
    """A policy's entry points: ``init(**settings)`` and ``update(state, k, v, q, scale, ...)``."""

    name: str
    init: Callable[..., Any]
    update: Callable[..., Any]
    state_type: type
    uses_queries: bool  # False: the rule never looks at attention (StreamingLLM)


POLICIES: dict[str, Policy] = {
    "tova": Policy("tova", init_tova_state, tova_update, TovaState, True),
    "h2o": Policy("h2o", init_h2o_state, h2o_update, H2OState, True),
    "streaming_llm": Policy(
        "streaming_llm", init_streaming_llm_state, streaming_llm_update, StreamingLLMState, False
    ),
    "snapkv": Policy("snapkv", init_snapkv_state, snapkv_update, SnapKVState, True),
    "morphkv": Policy("morphkv", init_morphkv_state, morphkv_update, MorphKVState, True),
}

__all__ = ["POLICIES", "Policy", "snapkv_compress"]
