"""Framework-neutral MLX KV-cache eviction primitives."""

from velox_cache_core.policies.tova import (
    PRESETS,
    TovaState,
    TovaStep,
    init_tova_state,
    tova_update,
)
from velox_cache_core.slots import KVSlots

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "KVSlots",
    "TovaState",
    "TovaStep",
    "init_tova_state",
    "tova_update",
]
