"""Framework-neutral MLX KV-cache eviction: the policies, and what drives them in a model.

Everything an integration needs is exported here (the names in ``__all__``), so that one never
imports a core submodule:

- the registry: :data:`POLICIES`, :func:`register`, :func:`policy_for_method`, the
  :class:`Policy` record and what it declares (:class:`PolicyState`, :func:`running`,
  :class:`Traits`, :class:`Setting`, :class:`Compressor`, :class:`LaneRule`,
  :class:`GlobalRule`);
- one layer's lifecycle: :class:`Layer` driven in a :class:`Mode`, its undo log
  (:func:`new_log`), quantized rows (:class:`Quant`), a batch of rows decoded together
  (:class:`LayerBatch`), a model-wide allocation (:class:`ModelShares`), tensor-parallel sums
  (:class:`StepSums`);
- RoPE positions compacted past the context (:class:`Compaction`, :class:`Rope`,
  :func:`rotate`);
- pinned spans, never evicted (:func:`pin` a state, :func:`spans` of it, :data:`MAX_SPANS`;
  ``Layer.pin`` on a layer);
- what a saved state holds (:class:`KVSlots`, :class:`QRows`, :class:`KRows`,
  :class:`Lanes`, :class:`History`, :class:`HistoryBefore`, :class:`UndoLog`, :class:`Entry`,
  :class:`LaneStep`, :func:`running_fields`, :func:`stored_fields`), for prompt-cache files;
- the batch functions (:mod:`batch <velox_cache_core.batch>`: ``batch.stack``,
  ``batch.update``, ``batch.attend``) and each policy's functional API (``init_tova_state``,
  ``tova_update``, ...).

The layer lifecycle (``Layer``, ``Mode``, ``LayerBatch``, ``indices``, ``ModelShares``,
``StepSums``) and ``batch`` are imported on first use (:func:`__getattr__`), so that importing
the package for the functional API does not import them (about a third of its import time).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from velox_cache_core.declarations import (
    Compressor,
    PolicyState,
    Setting,
    Traits,
    field_name,
    flag_name,
    read_settings,
    running,
    running_fields,
    setting_fields,
)
from velox_cache_core.engine import Call, Decision, Step
from velox_cache_core.history import History, HistoryBefore
from velox_cache_core.lanes import GlobalRule, LaneRule, Lanes
from velox_cache_core.pins import MAX_SPANS, pin, pin_room, seen_pinned, spans
from velox_cache_core.policies.expected_attention import (
    ExpectedAttentionState,
    expected_attention_compress,
    expected_attention_update,
    init_expected_attention_state,
)
from velox_cache_core.policies.expected_scores import expected_scores
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
from velox_cache_core.policy import Policy
from velox_cache_core.registry import (
    POLICIES,
    RESERVED_FLAGS,
    policy_for_method,
    register,
    reserve_flags,
    unregister,
)
from velox_cache_core.selection import pinned
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.rope_shift import Compaction, Rope, rotate
from velox_cache_core.store.rows import quant_of
from velox_cache_core.store.slots import KVSlots, stored_fields
from velox_cache_core.store.tier import Tier, TierSpec
from velox_cache_core.store.token_rows import KEY_LAYOUTS, QRows, Quant
from velox_cache_core.undo import Entry, LaneStep, UndoLog, new_log
from velox_cache_core.validation import check_choice, check_int

if TYPE_CHECKING:
    from velox_cache_core import batch
    from velox_cache_core.distributed import StepSums
    from velox_cache_core.layer import Layer, Mode
    from velox_cache_core.layer_batch import LayerBatch, indices
    from velox_cache_core.model_shares import ModelShares
else:
    # public name -> the submodule that defines it (the module itself for ``batch``)
    _ON_FIRST_USE = {
        "Layer": "layer",
        "Mode": "layer",
        "LayerBatch": "layer_batch",
        "indices": "layer_batch",
        "ModelShares": "model_shares",
        "StepSums": "distributed",
        "batch": "batch",
    }

    def __getattr__(name: str) -> Any:
        """The lifecycle names of ``__all__``, imported the first time one is asked for."""
        where = _ON_FIRST_USE.get(name)
        if where is None:
            raise AttributeError(f"module 'velox_cache_core' has no attribute {name!r}")
        module = importlib.import_module(f"velox_cache_core.{where}")
        value = module if name == where else getattr(module, name)
        globals()[name] = value
        return value


__version__ = "0.12.0"

__all__ = [
    "KEY_LAYOUTS",
    "MAX_SPANS",
    "POLICIES",
    "PRESETS",
    "RESERVED_FLAGS",
    "Call",
    "Compaction",
    "Compressor",
    "Decision",
    "Entry",
    "ExpectedAttentionState",
    "GlobalRule",
    "H2OState",
    "History",
    "HistoryBefore",
    "KRows",
    "KVSlots",
    "LaneRule",
    "LaneStep",
    "Lanes",
    "Layer",
    "LayerBatch",
    "Mode",
    "ModelShares",
    "MorphKVState",
    "Policy",
    "PolicyState",
    "QRows",
    "Quant",
    "Rope",
    "Setting",
    "SnapKVState",
    "Step",
    "StepSums",
    "StreamingLLMState",
    "Tier",
    "TierSpec",
    "TovaState",
    "TovaStep",
    "Traits",
    "UndoLog",
    "batch",
    "check_choice",
    "check_int",
    "expected_attention_compress",
    "expected_attention_update",
    "expected_scores",
    "field_name",
    "flag_name",
    "h2o_update",
    "indices",
    "init_expected_attention_state",
    "init_h2o_state",
    "init_morphkv_state",
    "init_snapkv_state",
    "init_streaming_llm_state",
    "init_tova_state",
    "morphkv_update",
    "new_log",
    "pin",
    "pin_room",
    "pinned",
    "policy_for_method",
    "quant_of",
    "read_settings",
    "register",
    "reserve_flags",
    "rotate",
    "running",
    "running_fields",
    "seen_pinned",
    "setting_fields",
    "snapkv_compress",
    "snapkv_update",
    "spans",
    "stored_fields",
    "streaming_llm_update",
    "tova_update",
    "unregister",
]
