"""The caches the benchmarks, the quality harness and the tools compare: every name is here.

The policies come from the registry (``velox_cache_core.POLICIES``, through
``velox_mlx_lm.config.methods()``): every registered method is a variant named after it, so a
policy registered later joins every suite without an edit here. The lists are functions,
computed when called (a test may register a policy after import). On top of the registry come
the bench-only variants that are not policies:

- baselines: mlx-lm's ``KVCache`` (``full``, micro ``mlx_kvcache``), its ``RotatingKVCache``
  (``rotating``, micro ``mlx_rotating``) and one SDPA call (micro ``sdpa``);
- ``tova_oneshot``: the ``tova`` method with one-shot prefill (model suite);
- the TOVA paper's signal × scope grid (its Table 3): micro rows ``tova_<signal>_<scope>`` and
  quality rows ``<method> (<signal>/<scope>)``, the method being the preset that gives the cell.

Import this module after :func:`velox_blas.preload_openblas` (it imports mlx).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from velox_cache_core import POLICIES, Policy, policy_for_method
from velox_mlx_lm import KVCacheConfig, methods
from velox_mlx_lm.config import FULL  # "full": mlx-lm's unbounded KVCache, a config method

__all__ = [
    "FULL",
    "MICRO_BASELINES",
    "MLX_KVCACHE",
    "MLX_ROTATING",
    "MODEL_BASELINES",
    "ONESHOT_METHODS",
    "ROTATING",
    "SDPA",
    "TOVA_POLICY",
    "Variant",
    "grid_name",
    "micro_methods",
    "micro_variants",
    "model_methods",
    "model_variants",
    "policy_variants",
    "reduced_model_methods",
    "tova_grid",
]

ROTATING = "rotating"  # mlx-lm's RotatingKVCache(max_size=budget, keep=4)
MODEL_BASELINES = (FULL, ROTATING)
MLX_KVCACHE = "mlx_kvcache"  # micro: KVCache trimmed back to the budget
MLX_ROTATING = "mlx_rotating"  # micro: RotatingKVCache(max_size=budget, keep=4)
SDPA = "sdpa"  # micro: one query attending to budget + 1 keys, the yardstick
MICRO_BASELINES = (MLX_KVCACHE, MLX_ROTATING, SDPA)
TOVA_POLICY = "tova"  # the headline policy: its signal × scope grid and its TOVA-only rows
ONESHOT_METHODS = ("tova",)  # methods also run with prefill="oneshot" (model suite)
SIGNALS = ("query", "key")
SCOPES = ("layer", "head")


@dataclass(frozen=True)
class Variant:
    """One row: a ``KVCacheConfig`` method plus fixed settings of its policy; budget varies.

    ``settings`` are the policy's own setting names (``signal``, not ``tova_signal``).
    """

    name: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def policy(self) -> Policy | None:
        """The registered policy behind ``method`` (``None`` for the full cache)."""
        return None if self.method == FULL else policy_for_method(self.method)

    def config(self, budget: int, **fields: Any) -> KVCacheConfig:
        """The config at ``budget`` (ignored by the full cache); ``fields``: further
        ``KVCacheConfig`` fields (``snapkv_window=8``), applied last."""
        policy = self.policy
        if policy is None:
            return KVCacheConfig(method=FULL, **fields)
        given = {"budget": budget, **self.settings}
        own = {f"{policy.name}_{k}": v for k, v in given.items()}
        return KVCacheConfig(method=self.method, **{**own, **fields})

    def state(self, budget: int) -> Any:
        """A fresh core state of the policy at ``budget`` (the config's, presets resolved)."""
        return self.config(budget).state()


def policy_variants() -> list[Variant]:
    """Every registered method as a variant named after it, in registry order; policies whose
    prompt end is a model pass (KVzip's reconstruction) are left out of these cache-only suites."""
    return [
        Variant(m, m)
        for m in methods()
        if m != FULL and not policy_for_method(m).prompt_end_needs_model
    ]


def tova_grid() -> Iterator[tuple[str, str, str]]:
    """``(method, signal, scope)`` per cell of the TOVA grid, signal-major; ``method`` is the
    preset that gives the cell (``tova`` query/layer, ``tova_adapted`` key/head), else the
    policy's first method."""
    policy = POLICIES[TOVA_POLICY]
    for signal in SIGNALS:
        for scope in SCOPES:
            method = next(
                (
                    m
                    for m, preset in policy.presets.items()
                    if (preset.get("signal"), preset.get("scope")) == (signal, scope)
                ),
                policy.methods[0],
            )
            yield method, signal, scope


def grid_name(method: str, signal: str, scope: str, *notes: str) -> str:
    """A quality row of the TOVA grid: ``tova (query/layer)``, ``tova (query/layer, n_sink=0)``."""
    return f"{method} ({', '.join([f'{signal}/{scope}', *notes])})"


def micro_variants() -> list[Variant]:
    """The micro suite's policy rows: the TOVA grid, then every other policy's methods."""
    grid = [
        Variant(f"{TOVA_POLICY}_{signal}_{scope}", method, {"signal": signal, "scope": scope})
        for method, signal, scope in tova_grid()
    ]
    others = [v for v in policy_variants() if _policy_name(v) != TOVA_POLICY]
    return grid + others


def micro_methods() -> list[str]:
    """Every micro row name: the policy rows, then the baselines."""
    return [v.name for v in micro_variants()] + list(MICRO_BASELINES)


def model_variants() -> list[Variant]:
    """The model suite's policy rows: every registered method, ``<method>_oneshot`` after it
    for :data:`ONESHOT_METHODS`."""
    out = []
    for variant in policy_variants():
        out.append(variant)
        if variant.method in ONESHOT_METHODS:
            out.append(Variant(f"{variant.method}_oneshot", variant.method, {"prefill": "oneshot"}))
    return out


def model_methods() -> list[str]:
    """Every model-suite row name: the baselines, then the policy rows."""
    return list(MODEL_BASELINES) + [v.name for v in model_variants()]


def reduced_model_methods() -> list[str]:
    """The rows of the model suite's reduced contexts: the baselines and the TOVA rows."""
    tova = [v.name for v in model_variants() if _policy_name(v) == TOVA_POLICY]
    return list(MODEL_BASELINES) + tova


def _policy_name(variant: Variant) -> str | None:
    policy = variant.policy
    return None if policy is None else policy.name
