"""KVCacheConfig: one validated, frozen description of the cache every layer gets."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from velox_cache_core.policies import POLICIES
from velox_cache_core.policies.tova import PRESETS
from velox_cache_core.validation import check_choice, check_int

TOVA_METHODS = tuple(PRESETS)  # "tova", "tova_adapted"
SIBLING_METHODS = ("h2o", "streaming_llm", "snapkv", "morphkv")
METHODS = (*TOVA_METHODS, *SIBLING_METHODS, "full")


@dataclass(frozen=True)
class KVCacheConfig:
    """Which cache to build and its settings, one ``<method>_<field>`` per policy setting.

    ``method``: ``"tova"`` (paper-faithful preset), ``"tova_adapted"`` (key-as-query, per head),
    ``"h2o"``, ``"streaming_llm"``, ``"snapkv"``, ``"morphkv"`` or ``"full"`` (mlx-lm's
    unbounded ``KVCache``). ``tova_signal``/``tova_scope``/``tova_prefill`` default to the chosen
    TOVA preset's values. ``head_dim``, if given, is checked against the model by
    ``KVCacheBuilder.for_model``. Every field is validated at construction, whatever the method.
    """

    method: str = "tova"
    tova_budget: int = 512
    tova_n_sink: int = 4
    tova_signal: str | None = None
    tova_scope: str | None = None
    tova_prefill: str | None = None
    h2o_budget: int = 512
    h2o_n_sink: int = 4
    h2o_recent: int | None = None  # None: budget // 2
    h2o_signal: str = "query"
    h2o_scope: str = "head"
    h2o_prefill: str = "sequential"
    streaming_llm_budget: int = 512
    streaming_llm_n_sink: int = 4
    snapkv_budget: int = 512
    snapkv_window: int = 32
    snapkv_kernel: int = 5
    snapkv_signal: str = "query"
    morphkv_budget: int = 512
    morphkv_n_sink: int = 4
    morphkv_window: int = 8
    morphkv_fusion: str = "mean"
    morphkv_signal: str | None = None
    morphkv_scope: str | None = None
    morphkv_prefill: str | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise TypeError(f"method must be a str, got {type(self.method).__name__}")
        check_choice("method", self.method, METHODS)
        for policy in POLICIES:
            try:
                POLICIES[policy].init(**self._settings(policy))
            except (TypeError, ValueError) as exc:  # name the config field, not the argument
                raise type(exc)(f"{policy}_{exc}") from None
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim, minimum=1)

    def _settings(self, policy: str) -> dict[str, Any]:
        prefix = f"{policy}_"
        out = {
            f.name[len(prefix) :]: getattr(self, f.name)
            for f in fields(self)
            if f.name.startswith(prefix)
        }
        if policy == "tova":
            preset = PRESETS[self.method if self.method in TOVA_METHODS else "tova"]
            out = {k: (preset[k] if v is None and k in preset else v) for k, v in out.items()}
        return out

    @property
    def policy(self) -> str | None:
        """The core policy behind ``method`` (``None`` for ``"full"``)."""
        if self.method in TOVA_METHODS:
            return "tova"
        return None if self.method == "full" else self.method

    def settings(self) -> dict[str, Any]:
        """Keyword arguments for the chosen policy's core ``init`` (preset defaults filled)."""
        if self.policy is None:
            return {}
        return self._settings(self.policy)

    def tova_settings(self) -> dict[str, Any]:
        """Keyword arguments for ``init_tova_state``, preset defaults filled in."""
        return self._settings("tova")

    @property
    def signal(self) -> str | None:
        """The attention signal the chosen method scores with (``None``: it does not)."""
        return self.settings().get("signal") or ("query" if self.policy == "morphkv" else None)
