"""KVCacheConfig: one validated, frozen description of the cache every layer gets.

Its settings come from the policy registry: every registered policy's typed settings
(``Policy.settings``, read from its ``init``) are given as ``<policy>_<setting>`` keyword
arguments (``KVCacheConfig(method="tova", tova_budget=512)``) and held per policy as a
:class:`PolicySettings`, validated once. The methods are the registry's method names plus
``"full"`` (mlx-lm's unbounded ``KVCache``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from velox_cache_core import (
    POLICIES,
    Policy,
    Quant,
    TierSpec,
    check_choice,
    check_int,
    field_name,
    policy_for_method,
)
from velox_mlx_lm.cache import TRIM_WINDOW
from velox_mlx_lm.positions import COMPACT_POLICIES, POSITIONS

FULL = "full"


def methods() -> tuple[str, ...]:
    """Every method a config (or ``--method``) accepts, in registry order, ``"full"`` last."""
    return (*(m for policy in POLICIES.values() for m in policy.methods), FULL)


def config_fields() -> dict[str, tuple[Policy, str, Any]]:
    """``<policy>_<setting>`` -> (policy, setting, default) for every registered policy."""
    return {
        field_name(policy.name, s.name): (policy, s.name, s.default)
        for policy in POLICIES.values()
        for s in policy.settings
    }


@dataclass(frozen=True)
class PolicySettings:
    """One policy's settings as a config gives them: ``given`` (every setting, ``None`` where
    the method's preset decides), ``method`` (the method they were validated under) and
    ``state`` (the empty core state ``init`` made from them: the validation, done once)."""

    policy: Policy
    method: str
    given: Mapping[str, Any]
    state: Any

    def resolved(self) -> dict[str, Any]:
        """The settings with the preset's choices filled in."""
        made = self.state.settings
        return {k: (made[k] if v is None and k in made else v) for k, v in self.given.items()}


def _policy_settings(policy: Policy, method: str, fields: Mapping[str, Any]) -> PolicySettings:
    """Validate one policy's settings (an error names the config field)."""
    chosen = method if method in policy.methods else policy.methods[0]
    given = {
        s.name: fields.get(field_name(policy.name, s.name), s.default) for s in policy.settings
    }
    try:
        state = policy.init_for(chosen, **given)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{policy.name}_{exc}") from None
    return PolicySettings(policy, chosen, MappingProxyType(given), state)


class KVCacheConfig:
    """Which cache to build and its settings, one ``<policy>_<setting>`` per policy setting.

    ``method``: any registered policy's method (``"tova"``, ``"tova_adapted"``, ``"h2o"``,
    ``"streaming_llm"``, ``"snapkv"``, ``"morphkv"``, ``"kvzip"``, ...) or ``"full"`` (mlx-lm's
    unbounded ``KVCache``). Settings left at ``None`` take the chosen method's preset.
    ``head_dim``, if given, is checked against the model by ``KVCacheBuilder.for_model``.
    ``trim_window``: how many of the last tokens a Velox cache can take back exactly (its undo
    log, for speculative decoding and prompt-cache rewinds; 0 turns trims off).
    ``kv_bits``/``kv_group_size``: keep the rows quantized (``mx.quantize``'s per-token layout:
    bits 1-6 or 8, groups of 32, 64 or 128 features), for every method; with ``"full"`` the
    cache is mlx-lm's ``QuantizedKVCache``. ``None`` keeps the model's precision.
    ``kv_key_layout``: ``"token"`` quantizes keys like values, each row along its features
    (mlx-lm's layout); ``"channel"`` quantizes them KIVI's way, each feature over groups of
    ``kv_group_size`` tokens with the newest in a full-precision window (needs the attention
    hook; the layout that keeps 4 and 2 bits usable, docs/quantized.md).
    ``positions``: ``"absolute"`` (keys rotated at their token index, the default) or
    ``"compact"`` (past the model's context, the kept rows are shifted down so that no
    query-to-key RoPE distance exceeds it: docs/architecture.md, "Positions"; for
    ``tova``, ``h2o`` and ``streaming_llm``, uniform allocation, keys at full precision or
    quantized per token).
    ``demote_bits``/``demote_budget``: keep the rows the policy evicts in a demoted tier of
    ``demote_budget`` rows per KV head at ``demote_bits`` (2 or 4; keys per channel, values
    per token), attended with the main rows in one softmax (docs/architecture.md, "The
    demoted tier"); ``None`` drops them. Uniform allocation, the attention hook, no trims.
    ``context``: the context ``"compact"`` keeps distances within (``None``: the model's
    ``max_position_embeddings``, read by ``KVCacheBuilder.for_model``).
    Every policy's settings are validated once, at construction, whatever the method; the
    object is frozen. Read a field with :meth:`value`, a policy's with :meth:`settings_of`.
    """

    method: str
    head_dim: int | None
    trim_window: int
    kv_bits: int | None
    kv_group_size: int
    kv_key_layout: str
    positions: str
    context: int | None
    demote_bits: int | None
    demote_budget: int | None
    _policies: Mapping[str, PolicySettings]

    def __init__(
        self,
        method: str = "tova",
        head_dim: int | None = None,
        trim_window: int = TRIM_WINDOW,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kv_key_layout: str = "token",
        positions: str = "absolute",
        context: int | None = None,
        demote_bits: int | None = None,
        demote_budget: int | None = None,
        **fields: Any,
    ) -> None:
        if not isinstance(method, str):
            raise TypeError(f"method must be a str, got {type(method).__name__}")
        check_choice("method", method, methods())
        known = config_fields()
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise TypeError(
                f"KVCacheConfig got unknown fields {unknown}; fields are method, head_dim, "
                "trim_window, kv_bits, kv_group_size, kv_key_layout, positions, context, "
                "demote_bits, demote_budget and "
                "<policy>_<setting>: "
                f"{', '.join(known)}"
            )
        if head_dim is not None:
            check_int("head_dim", head_dim, minimum=1)
        check_int("trim_window", trim_window, minimum=0)
        if not isinstance(kv_key_layout, str):
            raise TypeError(f"kv_key_layout must be a str, got {type(kv_key_layout).__name__}")
        # validates all three, by name
        Quant(4 if kv_bits is None else kv_bits, kv_group_size, kv_key_layout)
        if not isinstance(positions, str):
            raise TypeError(f"positions must be a str, got {type(positions).__name__}")
        check_choice("positions", positions, POSITIONS)
        if context is not None:
            check_int("context", context, minimum=2)
        policies = {p.name: _policy_settings(p, method, fields) for p in POLICIES.values()}
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "trim_window", trim_window)
        object.__setattr__(self, "kv_bits", kv_bits)
        object.__setattr__(self, "kv_group_size", kv_group_size)
        object.__setattr__(self, "kv_key_layout", kv_key_layout)
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "demote_bits", demote_bits)
        object.__setattr__(self, "demote_budget", demote_budget)
        object.__setattr__(self, "_policies", MappingProxyType(policies))
        if kv_key_layout == "channel":
            self._check_channel_keys()
        if positions == "compact":
            self._check_compact()
        if demote_bits is not None or demote_budget is not None:
            self._check_demote()

    def _check_compact(self) -> None:
        """``positions="compact"`` shifts full-precision rows of the policies whose rows it can
        shift, laid below one budget in every layer."""
        if self.policy is not None and self.policy not in COMPACT_POLICIES:
            raise ValueError(
                f"positions='compact' supports the methods of {', '.join(COMPACT_POLICIES)} "
                f"(and 'full', which keeps every row and never shifts); method "
                f"{self.method!r} keeps rows it cannot shift: use positions='absolute'"
            )
        if self.kv_bits is not None and self.kv_key_layout != "token":
            raise ValueError(
                "positions='compact' shifts keys quantized per token: use "
                f"kv_key_layout='token' (got {self.kv_key_layout!r}), or positions='absolute'"
            )
        allocation = self.settings().get("allocation", "uniform")
        if allocation != "uniform":
            raise ValueError(
                f"positions='compact' needs {self.policy}_allocation='uniform' (got "
                f"{allocation!r}); or use positions='absolute'"
            )

    def _check_demote(self) -> None:
        """A demoted tier needs both settings, a Velox method and uniform allocation; it takes
        the width's group from ``kv_group_size``."""
        if self.demote_bits is None or self.demote_budget is None:
            raise ValueError(
                "a demoted tier needs both demote_bits (2 or 4) and demote_budget (rows per "
                f"KV head), got demote_bits={self.demote_bits!r}, "
                f"demote_budget={self.demote_budget!r}"
            )
        TierSpec(self.demote_bits, self.demote_budget, self.kv_group_size)  # validates, by name
        if self.policy is None:
            raise ValueError(
                "demote_bits keeps what a Velox policy evicts: method='full' evicts nothing"
            )
        allocation = self.settings().get("allocation", "uniform")
        if allocation != "uniform":
            raise ValueError(
                f"demote_bits needs {self.policy}_allocation='uniform' (got {allocation!r}): "
                "heads keeping different row counts have no tier; or use demote_bits=None"
            )

    def for_draft(self) -> KVCacheConfig:
        """The config a draft model's caches take (speculative decoding): this one without a
        demoted tier. mlx-lm trims a draft's cache back over several of its single-token
        calls, and a tier takes back only its last call (``velox_cache_core.demoted``)."""
        if self.demote_bits is None and self.demote_budget is None:
            return self
        return self.replace(demote_bits=None, demote_budget=None)

    @property
    def demote(self) -> TierSpec | None:
        """The demoted tier's settings (``None``: evicted rows are dropped)."""
        if self.demote_bits is None or self.demote_budget is None:
            return None
        return TierSpec(self.demote_bits, self.demote_budget, self.kv_group_size)

    def _check_channel_keys(self) -> None:
        """``kv_key_layout="channel"`` is a Velox store's layout, for stores whose heads keep
        their own rows in order (not mlx-lm's cache, not lanes), quantized."""
        if self.kv_bits is None:
            raise ValueError(
                "kv_key_layout='channel' lays out quantized keys: give kv_bits (2 or 4, say)"
            )
        if self.policy is None:
            raise ValueError(
                "kv_key_layout='channel' is a Velox layout: method='full' gives mlx-lm's "
                "QuantizedKVCache, which quantizes keys per token; use kv_key_layout='token'"
            )
        allocation = self.settings().get("allocation", "uniform")
        if allocation != "uniform":
            raise ValueError(
                f"kv_key_layout='channel' needs {self.policy}_allocation='uniform' (got "
                f"{allocation!r}): heads keeping different row counts share lanes, which "
                "regroup rows across heads; or use kv_key_layout='token'"
            )

    # -- frozen value object -------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def _values(self) -> dict[str, Any]:
        return {
            field_name(name, setting): value
            for name, settings in self._policies.items()
            for setting, value in settings.given.items()
        }

    def _key(self) -> tuple[Any, ...]:
        values = tuple(sorted(self._values().items()))
        quant = (self.kv_bits, self.kv_group_size, self.kv_key_layout)
        where = (self.positions, self.context)
        tier = (self.demote_bits, self.demote_budget)
        return (self.method, self.head_dim, self.trim_window, quant, where, tier, values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        defaults = config_fields()
        changed = {k: v for k, v in self._values().items() if v != defaults[k][2]}
        args = ", ".join(f"{k}={v!r}" for k, v in {"method": self.method, **changed}.items())
        extra = "" if self.head_dim is None else f", head_dim={self.head_dim!r}"
        if self.trim_window != TRIM_WINDOW:
            extra += f", trim_window={self.trim_window!r}"
        if self.kv_bits is not None:
            extra += f", kv_bits={self.kv_bits!r}"
        if self.kv_group_size != 64:
            extra += f", kv_group_size={self.kv_group_size!r}"
        if self.kv_key_layout != "token":
            extra += f", kv_key_layout={self.kv_key_layout!r}"
        if self.positions != "absolute":
            extra += f", positions={self.positions!r}"
        if self.context is not None:
            extra += f", context={self.context!r}"
        if self.demote_bits is not None:
            extra += f", demote_bits={self.demote_bits!r}, demote_budget={self.demote_budget!r}"
        return f"KVCacheConfig({args}{extra})"

    def value(self, name: str) -> Any:
        """One ``<policy>_<setting>`` field's value as given (``None``: the preset decides)."""
        values = self._values()
        if name not in values:
            raise KeyError(f"KVCacheConfig has no field {name!r}")
        return values[name]

    def fields(self) -> dict[str, Any]:
        """Every field's value (``method``, ``head_dim``, ``trim_window`` and each
        ``<policy>_<setting>``)."""
        return {
            "method": self.method,
            "head_dim": self.head_dim,
            "trim_window": self.trim_window,
            "kv_bits": self.kv_bits,
            "kv_group_size": self.kv_group_size,
            "kv_key_layout": self.kv_key_layout,
            "positions": self.positions,
            "context": self.context,
            "demote_bits": self.demote_bits,
            "demote_budget": self.demote_budget,
            **self._values(),
        }

    def replace(self, **changes: Any) -> KVCacheConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        return KVCacheConfig(**{**self.fields(), **changes})

    # -- what the builder asks ---------------------------------------------------------------------
    @property
    def quant(self) -> Quant | None:
        """How the rows are quantized (``None``: the model's precision)."""
        return Quant.of(self.kv_bits, self.kv_group_size, self.kv_key_layout)

    @property
    def policy(self) -> str | None:
        """The core policy behind ``method`` (``None`` for ``"full"``)."""
        return None if self.method == FULL else policy_for_method(self.method).name

    @property
    def record(self) -> Policy | None:
        """The registry's record of the chosen policy (``None`` for ``"full"``)."""
        return None if self.policy is None else POLICIES[self.policy]

    def settings_of(self, policy: str) -> PolicySettings:
        """One policy's settings as this config gives them."""
        if policy not in self._policies:
            raise KeyError(f"no registered policy {policy!r}; registered: {sorted(POLICIES)}")
        return self._policies[policy]

    def settings(self) -> dict[str, Any]:
        """The chosen policy's settings with the method's preset filled in (``{}`` for full)."""
        return {} if self.policy is None else self.policy_settings(self.policy)

    def policy_settings(self, policy: str) -> dict[str, Any]:
        """One policy's settings as this config gives them, preset defaults filled in."""
        return self.settings_of(policy).resolved()

    def tova_settings(self) -> dict[str, Any]:
        """Keyword arguments for ``init_tova_state``, preset defaults filled in."""
        return self.policy_settings("tova")

    def state(self) -> Any:
        """A fresh core state of the chosen policy (``None`` for ``"full"``)."""
        return None if self.policy is None else self._policies[self.policy].state

    @property
    def signal(self) -> str | None:
        """The attention signal the chosen method scores with (``None``: it does not)."""
        record = self.record
        return None if record is None else record.traits.signal(self.state())
