"""KVCacheConfig: one validated, frozen description of the cache every layer gets.

Its fields come from the policy registry: every registered policy's settings (the keyword
arguments of its ``init``) appear as ``<policy>_<setting>``, with ``init``'s defaults; the
methods are the registry's method names plus ``"full"`` (mlx-lm's unbounded ``KVCache``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from velox_cache_core.registry import POLICIES, Policy, policy_for_method
from velox_cache_core.validation import check_choice, check_int
from velox_mlx_lm.cache import TRIM_WINDOW

FULL = "full"


def methods() -> tuple[str, ...]:
    """Every method a config (or ``--method``) accepts, in registry order, ``"full"`` last."""
    return (*(m for policy in POLICIES.values() for m in policy.methods), FULL)


def config_fields() -> dict[str, tuple[Policy, str, Any]]:
    """``<policy>_<setting>`` -> (policy, setting, default) for every registered policy."""
    out = {}
    for policy in POLICIES.values():
        for setting, default in policy.defaults().items():
            out[f"{policy.name}_{setting}"] = (policy, setting, default)
    return out


class KVCacheConfig:
    """Which cache to build and its settings, one ``<policy>_<setting>`` per policy setting.

    ``method``: ``"tova"`` (paper-faithful preset), ``"tova_adapted"`` (key-as-query, per head),
    ``"h2o"``, ``"streaming_llm"``, ``"snapkv"``, ``"morphkv"`` (any registered policy's method)
    or ``"full"`` (mlx-lm's unbounded ``KVCache``). Settings left at ``None`` take the chosen
    method's preset (``tova_signal``/``tova_scope``/``tova_prefill`` for the TOVA presets).
    ``head_dim``, if given, is checked against the model by ``KVCacheBuilder.for_model``.
    ``trim_window``: how many of the last tokens a Velox cache can take back exactly (its undo
    log, for speculative decoding and prompt-cache rewinds; 0 turns trims off).
    Every field is validated at construction, whatever the method; the object is frozen.
    """

    method: str
    head_dim: int | None
    trim_window: int

    def __init__(
        self,
        method: str = "tova",
        head_dim: int | None = None,
        trim_window: int = TRIM_WINDOW,
        **fields: Any,
    ) -> None:
        if not isinstance(method, str):
            raise TypeError(f"method must be a str, got {type(method).__name__}")
        check_choice("method", method, methods())
        known = config_fields()
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise TypeError(
                f"KVCacheConfig got unknown fields {unknown}; fields are method, head_dim and "
                f"<policy>_<setting>: {', '.join(known)}"
            )
        if head_dim is not None:
            check_int("head_dim", head_dim, minimum=1)
        check_int("trim_window", trim_window, minimum=0)
        values = {name: fields.get(name, default) for name, (_, _, default) in known.items()}
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "trim_window", trim_window)
        object.__setattr__(self, "_values", values)
        for policy in POLICIES.values():
            try:
                self._init(policy)
            except (TypeError, ValueError) as exc:  # name the config field, not the argument
                raise type(exc)(f"{policy.name}_{exc}") from None

    # -- frozen value object -------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"KVCacheConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def _key(self) -> tuple[Any, ...]:
        values = tuple(sorted(self._values.items()))
        return (self.method, self.head_dim, self.trim_window, values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        changed = {
            name: value for name, value in self._values.items() if value != config_fields()[name][2]
        }
        args = ", ".join(f"{k}={v!r}" for k, v in {"method": self.method, **changed}.items())
        extra = "" if self.head_dim is None else f", head_dim={self.head_dim!r}"
        if self.trim_window != TRIM_WINDOW:
            extra += f", trim_window={self.trim_window!r}"
        return f"KVCacheConfig({args}{extra})"

    def fields(self) -> dict[str, Any]:
        """Every field's value (``method``, ``head_dim``, ``trim_window`` and each
        ``<policy>_<setting>``)."""
        return {
            "method": self.method,
            "head_dim": self.head_dim,
            "trim_window": self.trim_window,
            **self._values,
        }

    def replace(self, **changes: Any) -> KVCacheConfig:
        """A copy with ``changes`` applied (validated like a new config)."""
        fields = {**self.fields(), **changes}
        return KVCacheConfig(**fields)

    # -- what the builder asks ---------------------------------------------------------------------
    def _settings(self, policy: Policy) -> dict[str, Any]:
        prefix = f"{policy.name}_"
        return {
            name[len(prefix) :]: value
            for name, value in self._values.items()
            if name.startswith(prefix)
        }

    def _method_for(self, policy: Policy) -> str:
        """The method a policy's settings are validated and resolved under."""
        return self.method if self.method in policy.methods else policy.methods[0]

    def _init(self, policy: Policy) -> Any:
        return policy.init_for(self._method_for(policy), **self._settings(policy))

    @property
    def policy(self) -> str | None:
        """The core policy behind ``method`` (``None`` for ``"full"``)."""
        return None if self.method == FULL else policy_for_method(self.method).name

    def settings(self) -> dict[str, Any]:
        """The chosen policy's settings with the method's preset filled in (``{}`` for full)."""
        if self.policy is None:
            return {}
        return self.policy_settings(self.policy)

    def policy_settings(self, policy: str) -> dict[str, Any]:
        """One policy's settings as this config gives them, preset defaults filled in."""
        record = POLICIES[policy]
        given = self._settings(record)
        resolved = self._init(record).settings
        return {k: (resolved[k] if v is None and k in resolved else v) for k, v in given.items()}

    def tova_settings(self) -> dict[str, Any]:
        """Keyword arguments for ``init_tova_state``, preset defaults filled in."""
        return self.policy_settings("tova")

    def state(self) -> Any:
        """A fresh core state of the chosen policy (``None`` for ``"full"``)."""
        return None if self.policy is None else self._init(POLICIES[self.policy])

    @property
    def signal(self) -> str | None:
        """The attention signal the chosen method scores with (``None``: it does not)."""
        return getattr(self.state(), "signal", None)
