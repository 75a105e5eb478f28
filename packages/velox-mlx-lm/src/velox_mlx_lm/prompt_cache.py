"""Load a saved prompt cache and check it was made with the settings you expect."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import load_prompt_cache as _mlx_load

from velox_mlx_lm.builder import link_shares
from velox_mlx_lm.cache import PolicyKVCache
from velox_mlx_lm.config import KVCacheConfig


def load_prompt_cache(
    path: str, config: KVCacheConfig | None = None, return_metadata: bool = False
) -> Any:
    """``mlx_lm.models.cache.load_prompt_cache``, refusing a file made with other settings.

    With ``config``, every Velox layer cache must hold that policy with those settings, and a
    full cache must come from ``method="full"``; otherwise ``ValueError`` names the first layer
    that differs. Nothing is returned on error. Caches under a model-wide ``global``
    allocation are linked again (:func:`velox_mlx_lm.builder.link_shares`).
    """
    caches, metadata = _mlx_load(path, return_metadata=True)
    link_shares(caches)
    if config is not None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        # Resolve defaults (e.g. h2o recent) as a cache would.
        settings = None if config.policy is None else config.state().settings
        for i, cache in enumerate(caches):
            if isinstance(cache, PolicyKVCache):
                _check_layer(i, cache, config, settings)
            elif type(cache) is KVCache and config.policy is not None:
                raise ValueError(
                    f"prompt cache layer {i} is a full KVCache, but config asks for "
                    f"method={config.method!r}"
                )
    return (caches, metadata) if return_metadata else caches


def _check_layer(i: int, cache: PolicyKVCache, config: KVCacheConfig, settings: Any) -> None:
    """``ValueError`` naming layer ``i`` when it was saved with other settings than ``config``."""
    quant = cache.quant
    saved_bits = None if quant is None else quant.bits
    saved_group = config.kv_group_size if quant is None else quant.group_size
    saved_layout = config.kv_key_layout if quant is None else quant.keys
    asked = (config.kv_bits, config.kv_group_size, config.kv_key_layout)
    if (saved_bits, saved_group, saved_layout) != asked:
        raise ValueError(
            f"prompt cache layer {i} was saved with kv_bits={saved_bits} "
            f"(kv_group_size={saved_group}, kv_key_layout={saved_layout!r}), but "
            f"config asks for kv_bits={config.kv_bits} (kv_group_size="
            f"{config.kv_group_size}, kv_key_layout={config.kv_key_layout!r})"
        )
    if cache.positions_mode != config.positions:
        raise ValueError(
            f"prompt cache layer {i} was saved with positions="
            f"{cache.positions_mode!r}, but config asks for positions="
            f"{config.positions!r}"
        )
    tier = cache.layer.demote
    saved_tier = None if tier is None else (tier.bits, tier.budget)
    if saved_tier != (
        None if config.demote is None else (config.demote_bits, config.demote_budget)
    ):
        raise ValueError(
            f"prompt cache layer {i} was saved with a demoted tier "
            f"{saved_tier} (demote_bits, demote_budget), but config asks for "
            f"demote_bits={config.demote_bits}, demote_budget={config.demote_budget}"
        )
    saved = (cache.policy_name, cache.settings)
    wanted = (config.policy, settings)
    if saved != wanted:
        raise ValueError(
            f"prompt cache layer {i} was saved as {saved[0]} {saved[1]}, "
            f"but config asks for {wanted[0]} {wanted[1]}"
        )
