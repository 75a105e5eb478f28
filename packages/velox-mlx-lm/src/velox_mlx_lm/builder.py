"""Build one cache per layer from a KVCacheConfig and wire the attention hook."""

from __future__ import annotations

import warnings
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from velox_cache_core import Mode, ModelShares, Rope, StepSums
from velox_mlx_lm.cache import PolicyKVCache, cache_class
from velox_mlx_lm.config import KVCacheConfig
from velox_mlx_lm.distributed import tensor_group
from velox_mlx_lm.hook import install_attention_hook

AUTO = "auto"  # for_model's default group: the one the model's attention is sharded over


class KVCacheFactory:
    """One layer's cache for a config."""

    @staticmethod
    def create(config: KVCacheConfig, group: Any = None, mode: Mode = Mode.QUERIES) -> Any:
        """``group``: the tensor-parallel group of a sharded model (``docs/distributed.md``);
        ``mode``: where the layer decides (``velox_cache_core.layer.Mode``; the default stays
        correct whether or not the attention hook reaches the model)."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if config.policy is None:
            if config.kv_bits is not None:
                return QuantizedKVCache(group_size=config.kv_group_size, bits=config.kv_bits)
            return KVCache()
        cls = cache_class(config.policy)
        return cls(
            trim_window=config.trim_window,
            group=group,
            mode=mode,
            quant=config.quant,
            demote=config.demote,
            **config.settings(),
        )


def _base_caches(model: nn.Module) -> list[Any]:
    """The caches the model's own class would make (ignoring a ``make_cache`` set on the
    instance, which may be ours)."""
    make_cache = getattr(type(model), "make_cache", None)
    if make_cache is not None:
        return list(make_cache(model))
    return [KVCache() for _ in model.layers]


def _head_dims(model: nn.Module) -> set[int]:
    dims = set()
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "self_attn", None)
        n_kv = getattr(attn, "n_kv_heads", None)
        k_proj = getattr(attn, "k_proj", None)
        if attn is None:
            continue
        if isinstance(getattr(attn, "head_dim", None), int):
            dims.add(attn.head_dim)
        elif n_kv and k_proj is not None and hasattr(k_proj, "weight"):
            out = k_proj.weight.shape[0]
            if not hasattr(k_proj, "scales"):  # quantized weights pack several values per int
                dims.add(out // n_kv)
    return dims


class KVCacheBuilder:
    """Per-model cache lists."""

    @staticmethod
    def for_model(model: nn.Module, config: KVCacheConfig, group: Any = AUTO) -> list[Any]:
        """One cache per layer, every config field propagated, attention hook installed.

        Full-attention layers (mlx-lm ``KVCache``) get the configured cache; layers the model
        already bounds (``RotatingKVCache`` sliding windows) and non-attention layers keep theirs.
        ``group``: the tensor-parallel group layer-wide decisions are summed over; by default
        the one the model's attention is sharded over (``model.shard``, ``sharded_load``),
        ``None`` for an unsharded model. Passing ``None`` for a sharded model turns the
        communication off: the ranks then decide on their own heads and can diverge. With a
        group, the caches share one ``StepSums``: a decode step's layer-wide sums of every layer
        go out in one ``all_sum`` after the last layer's attention (``docs/distributed.md``).
        """
        _check_model(model, config)
        bases = _base_caches(model)
        if config.method == "full" and config.kv_bits is not None:
            return [_full_quantized(base, config) for base in bases]
        if config.method == "full" or not any(_unbounded(b) for b in bases):
            return bases  # nothing to evict: no hook, no warning
        reached = install_attention_hook(model)
        context = _compact_context(model, config, reached)
        if not reached:
            _refuse_quantized(model, config)
            if config.demote is not None:
                raise ValueError(
                    f"{type(model).__module__} computes attention by hand, where the hook "
                    "cannot attend the demoted tier: use demote_bits=None with this model"
                )
            config = _without_queries(model, config)
        # Decided once: without the hook no query ever comes back, so every call is decided
        # as it is laid out; with it, calls wait for their queries.
        mode = Mode.QUERIES if reached else Mode.AT_ONCE
        if isinstance(group, str) and group == AUTO:
            group = tensor_group(model)
        name = model_type(model)

        def maker(index: int) -> Any:
            layer_config = _with_rope(model, config, index)

            def make(label: str, nested: bool) -> PolicyKVCache:
                cache = KVCacheFactory.create(layer_config, group, mode)
                cache.layer.serves = f"{name} ({label})"
                # a nested cache the model might use outside attention: refuse such a use
                cache.layer.must_attend = nested and reached > 0
                if context is not None:
                    cache.compact_positions(context, compact_rope(model, index))
                return cache

            return make

        caches = [_convert(base, maker(i), f"layer {i}") for i, base in enumerate(bases)]
        _mark_unshared(model, bases, caches)
        _share_step_sums([c for base in caches for c in _members(base)])
        return link_shares(caches)


def link_shares(caches: list[Any]) -> list[Any]:
    """Link the Velox caches of one model whose policy cuts each layer by itself (SnapKV,
    Expected Attention, TOVA, H2O) under ``allocation="global"``: they are then cut together
    by one model-wide threshold (:class:`velox_cache_core.model_shares.ModelShares`). The
    builder and :func:`velox_mlx_lm.load_prompt_cache` call it; ``caches`` is returned."""
    ours = [
        c
        for base in caches
        for c in _members(base)
        if isinstance(c, PolicyKVCache)
        and c.layer.policy.global_rule is not None
        and c.settings.get("allocation") == "global"
    ]
    if ours:
        shares = ModelShares()
        for cache in ours:
            shares.join(cache.layer)
    return caches


def model_type(model: nn.Module) -> str:
    """The model's mlx-lm type (``"deepseek_v3"``), for messages."""
    for owner in (model, getattr(model, "args", None), getattr(model, "config", None)):
        value = getattr(owner, "model_type", None)
        if isinstance(value, str):
            return value
    return type(model).__module__.rsplit(".", 1)[-1]


def _unbounded(cache: Any) -> bool:
    """Whether ``cache`` is, or nests, an unbounded full-attention ``KVCache``."""
    if type(cache) is CacheList:
        return any(_unbounded(c) for c in cache.caches)
    return type(cache) is KVCache


def _mark_unshared(model: nn.Module, bases: list[Any], caches: list[Any]) -> None:
    """A model with a cache per layer shares no layer's keys and values (mlx-lm's KV sharing,
    gemma3n and afm7, gives some layers none): its caches may drop a call's copies once it is
    attended (``PolicyKVCache.shared_rows``)."""
    if len(bases) != len(getattr(model, "layers", ())):
        return
    for cache in caches:
        for member in _members(cache):
            if isinstance(member, PolicyKVCache):
                member.shared_rows = False


def _members(cache: Any) -> list[Any]:
    return list(cache.caches) if type(cache) is CacheList else [cache]


def _convert(base: Any, make: Any, label: str) -> Any:
    """A full-attention ``KVCache`` becomes a Velox cache, at the top level or inside a
    ``CacheList`` (hybrid layers: recurrent state beside attention, two attention blocks);
    sliding windows and recurrent state are already bounded and stay."""
    if type(base) is KVCache:
        return make(label, False)
    if type(base) is CacheList:
        members = [
            make(f"{label}, CacheList member {j}", True) if type(c) is KVCache else c
            for j, c in enumerate(base.caches)
        ]
        return CacheList(*members)
    return base


def _full_quantized(base: Any, config: KVCacheConfig) -> Any:
    """``method="full"`` with ``kv_bits``: mlx-lm's ``QuantizedKVCache`` for each full-attention
    layer (as ``mlx_lm.generate`` quantizes them); other layers keep their caches."""
    if type(base) is KVCache:
        return KVCacheFactory.create(config)
    return base


def _refuse_quantized(model: nn.Module, config: KVCacheConfig) -> None:
    """Quantized rows need an attention that reads them: the hook's, or mlx-lm's quantized
    SDPA. A model that computes attention by hand has neither: refuse it."""
    if config.kv_bits is not None:
        raise ValueError(
            f"{model_type(model)} computes attention by hand, so neither the Velox attention "
            "hook nor mlx-lm's quantized attention reaches it: quantized rows (kv_bits="
            f"{config.kv_bits}) cannot be served there; use kv_bits=None"
        )


def _check_model(model: nn.Module, config: KVCacheConfig) -> None:
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if not hasattr(model, "layers"):
        raise TypeError("model must be an mlx-lm model (it has no .layers)")
    dims = _head_dims(model)
    if config.head_dim is not None and dims and config.head_dim not in dims:
        raise ValueError(
            f"head_dim={config.head_dim} does not match the model's head_dim {sorted(dims)}"
        )
    quant = config.quant
    if quant is not None:
        for dim in sorted(dims):
            quant.check_width(dim, "the model's head_dim")
    tier = config.demote
    if tier is not None:
        for dim in sorted(dims):
            tier.check_width(dim, "the model's head_dim")


def _without_queries(model: nn.Module, config: KVCacheConfig) -> KVCacheConfig:
    """The config for a model the hook does not reach: signal ``key`` where it scored by
    ``query`` (with a warning); a policy that scores by the queries without a ``signal``
    setting (Expected Attention) has no stand-in and is refused."""
    if config.signal != "query":
        return config
    record = config.record
    assert record is not None
    if "signal" not in record.setting_names:
        raise ValueError(
            f"{type(model).__module__} computes attention by hand, so the hook cannot give "
            f"the cache the true queries, and method {config.method!r} needs them (it has no "
            "signal='key' stand-in); use another method"
        )
    field = f"{config.policy}_signal"
    warnings.warn(
        f"{type(model).__module__} computes attention by hand, so the hook cannot give "
        f"the cache the true queries; using {field}='key' instead.",
        RuntimeWarning,
        stacklevel=3,
    )
    return config.replace(**{field: "key"})


def _share_step_sums(caches: list[Any]) -> None:
    """Every sharded layer's decode-step sums go out in one ``all_sum`` per forward pass
    (not a layer with a demoted tier: it decides each call with its queries)."""
    ours = [
        c
        for c in caches
        if isinstance(c, PolicyKVCache) and c.group is not None and c.layer.demote is None
    ]
    if ours:
        sums = StepSums(ours[0].group, len(ours))
        for layer, cache in enumerate(ours):
            cache.share_step_sums(sums, layer)


# The settings a policy that un-rotates its queries declares (Expected Attention), and what
# mlx's ``nn.RoPE`` calls them: the builder fills them in from the model's RoPE.
ROPE_SETTINGS = {
    "rope_base": "base",
    "rope_dims": "dims",
    "rope_traditional": "traditional",
    "rope_scale": "scale",
}


def _with_rope(model: nn.Module, config: KVCacheConfig, index: int) -> KVCacheConfig:
    """``config`` with layer ``index``'s RoPE (base, dims, traditional, scale) in the chosen
    policy's ``rope_*`` settings, for a policy that declares them and where the config leaves
    ``rope_base`` unset (set, the config's values are taken as they are)."""
    record = config.record
    if record is None or not set(ROPE_SETTINGS) <= set(record.setting_names):
        return config
    if config.value(f"{record.name}_rope_base") is not None:
        return config
    rope = _rope_module(model, index)
    if not isinstance(rope, nn.RoPE):
        found = "no RoPE module" if rope is None else f"a {type(rope).__name__}"
        raise ValueError(
            f"{model_type(model)} layer {index} has {found}; {record.name} reads only mlx's "
            f"nn.RoPE (plain or linearly scaled) off a model: give "
            f"{', '.join(f'{record.name}_{s}' for s in ROPE_SETTINGS)} yourself "
            f"({record.name}_rope_dims=0 for a model without RoPE)"
        )
    facts = {f"{record.name}_{s}": getattr(rope, name) for s, name in ROPE_SETTINGS.items()}
    return config.replace(**facts)


def model_context(model: nn.Module) -> int | None:
    """The model's trained context (``max_position_embeddings`` of its args), or ``None``."""
    for owner in (getattr(model, "args", None), getattr(model, "config", None)):
        value = getattr(owner, "max_position_embeddings", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _compact_context(model: nn.Module, config: KVCacheConfig, reached: int) -> int | None:
    """The context ``positions="compact"`` keeps distances within (``None``: absolute
    positions); refuses a model the attention hook does not reach (the queries of a call
    that shifts are rotated there)."""
    if config.positions != "compact":
        return None
    if not reached:
        raise ValueError(
            f"{model_type(model)} computes attention by hand, so the Velox attention hook "
            "cannot rotate the queries of a call that shifts: positions='compact' needs it; "
            "use positions='absolute'"
        )
    context = config.context if config.context is not None else model_context(model)
    if context is None:
        raise ValueError(
            f"{model_type(model)} does not say its context (no max_position_embeddings): "
            "give KVCacheConfig(context=...) for positions='compact'"
        )
    return context


def compact_rope(model: nn.Module, index: int) -> Rope:
    """Layer ``index``'s rotation for ``positions="compact"``: mlx's ``nn.RoPE`` (plain or
    linearly scaled) only; other RoPE kinds (Llama 3, YaRN, LongRoPE frequencies) are
    refused with a ``ValueError``."""
    rope = _rope_module(model, index)
    if not isinstance(rope, nn.RoPE):
        found = "no RoPE module" if rope is None else f"a {type(rope).__name__}"
        raise ValueError(
            f"{model_type(model)} layer {index} has {found}; positions='compact' re-rotates "
            "keys for mlx's nn.RoPE (plain or linearly scaled) only: use positions='absolute'"
        )
    return Rope(
        dims=int(rope.dims),
        base=float(rope.base),
        traditional=bool(rope.traditional),
        scale=float(rope.scale),
    )


def _rope_module(model: nn.Module, index: int) -> Any:
    """The RoPE module of layer ``index`` (its attention's ``rope``), or ``None``."""
    layers = getattr(model, "layers", [])
    scopes = [layers[index]] if index < len(layers) else []
    for scope in [*scopes, model]:
        for path, module in scope.named_modules():
            if isinstance(module, nn.RoPE) or path.rsplit(".", 1)[-1] == "rope":
                return module
    return None
