"""KVCacheConfig: one validated, frozen description of the cache every layer gets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from velox_cache_core.policies.tova import PREFILLS, PRESETS, SCOPES, SIGNALS
from velox_cache_core.validation import check_budget_and_sinks, check_choice, check_int

TOVA_METHODS = tuple(PRESETS)  # "tova", "tova_adapted"
METHODS = (*TOVA_METHODS, "full")


@dataclass(frozen=True)
class KVCacheConfig:
    """Which cache to build and its settings.

    ``method``: ``"tova"`` (paper-faithful preset), ``"tova_adapted"`` (key-as-query, per head)
    or ``"full"`` (mlx-lm's unbounded ``KVCache``). ``tova_signal``/``tova_scope``/
    ``tova_prefill`` default to the chosen TOVA preset's values. ``head_dim``, if given, is
    checked against the model by ``KVCacheBuilder.for_model``.
    """

    method: str = "tova"
    tova_budget: int = 512
    tova_n_sink: int = 4
    tova_signal: str | None = None
    tova_scope: str | None = None
    tova_prefill: str | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str):
            raise TypeError(f"method must be a str, got {type(self.method).__name__}")
        check_choice("method", self.method, METHODS)
        check_budget_and_sinks(self.tova_budget, self.tova_n_sink, prefix="tova_")
        for name, options in (
            ("tova_signal", SIGNALS),
            ("tova_scope", SCOPES),
            ("tova_prefill", PREFILLS),
        ):
            value = getattr(self, name)
            if value is not None:
                check_choice(name, value, options)
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim, minimum=1)

    def tova_settings(self) -> dict[str, Any]:
        """Keyword arguments for ``init_tova_state``, preset defaults filled in."""
        preset = PRESETS[self.method if self.method in TOVA_METHODS else "tova"]
        return {
            "budget": self.tova_budget,
            "n_sink": self.tova_n_sink,
            "signal": self.tova_signal or preset["signal"],
            "scope": self.tova_scope or preset["scope"],
            "prefill": self.tova_prefill or preset["prefill"],
        }
