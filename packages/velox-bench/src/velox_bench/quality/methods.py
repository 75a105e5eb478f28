"""The cache variants the quality harness compares (names from :mod:`velox_bench.variants`).

Perplexity: the TOVA grid (plus the ``tova`` preset without sinks), then every other registered
method whose policy has no prompt-end step. Retrieval: every registered method, TOVA's presets
under their grid names. Registry-derived lists are functions, computed when called.
"""

from __future__ import annotations

import dataclasses

from velox_bench import variants
from velox_bench.variants import Variant

__all__ = [
    "FULL",
    "PROMPT_END_EXCLUDED",
    "TOVA",
    "TOVA_GRID",
    "TOVA_KEY_HEAD",
    "TOVA_NO_SINK",
    "Variant",
    "excluded_from_perplexity",
    "perplexity_variants",
    "retrieval_variants",
    "variant",
]

PROMPT_END_EXCLUDED = "compresses once at a prompt end; streaming text has none"


def _sequential(v: Variant) -> Variant:
    """``v`` with ``prefill="sequential"`` pinned where its policy has a prefill setting: it
    makes chunked scoring equal token-by-token decoding, whatever the presets' defaults are."""
    policy = v.policy
    if policy is None or "prefill" not in policy.setting_names:
        return v
    return dataclasses.replace(v, settings={**v.settings, "prefill": "sequential"})


FULL = Variant(variants.FULL, variants.FULL)
TOVA_GRID = tuple(
    _sequential(Variant(variants.grid_name(m, sig, sc), m, {"signal": sig, "scope": sc}))
    for m, sig, sc in variants.tova_grid()
)
_CELLS = {(v.settings["signal"], v.settings["scope"]): v for v in TOVA_GRID}
TOVA = _CELLS["query", "layer"]  # the `tova` preset (the TOVA paper's best)
TOVA_KEY_HEAD = _CELLS["key", "head"]  # the `tova_adapted` preset
TOVA_NO_SINK = Variant(
    variants.grid_name(TOVA.method, "query", "layer", "n_sink=0"),
    TOVA.method,
    {**TOVA.settings, "n_sink": 0},
)


def _others() -> list[Variant]:
    """Every registered method outside the TOVA policy, sequential prefill pinned."""
    return [
        _sequential(v)
        for v in variants.policy_variants()
        if v.policy is not None and v.policy.name != variants.TOVA_POLICY
    ]


def perplexity_variants() -> list[Variant]:
    """The grid (the preset first, then it without sinks), then the other policies' methods
    that have no prompt end (streaming text has none: see :func:`excluded_from_perplexity`)."""
    rest = [v for v in _others() if v.policy is not None and v.policy.prompt_end is None]
    return [TOVA, TOVA_NO_SINK, *(v for v in TOVA_GRID if v is not TOVA), *rest]


def excluded_from_perplexity() -> dict[str, str]:
    """Method -> why it is left out of streaming perplexity."""
    return {
        v.name: PROMPT_END_EXCLUDED
        for v in _others()
        if v.policy is not None and v.policy.prompt_end is not None
    }


KVZIP = Variant("kvzip", "kvzip")


def retrieval_variants() -> list[Variant]:
    """Every registered method in registry order; TOVA's presets as their grid cells; KVzip
    last (its reconstruction pass runs once per document, ``retrieval.run_batch``)."""
    chosen = {v.method: v for v in TOVA_GRID if _preset_cell(v)} | {v.method: v for v in _others()}
    return [chosen[v.method] for v in variants.policy_variants()] + [KVZIP]


def _preset_cell(v: Variant) -> bool:
    """Whether grid cell ``v`` is what its method's preset gives (not an override of it)."""
    policy = v.policy
    preset = policy.presets.get(v.method, {}) if policy is not None else {}
    cell = (v.settings["signal"], v.settings["scope"])
    return (preset.get("signal"), preset.get("scope")) == cell


def variant(name: str) -> Variant:
    """The full cache or one of the variants above, by row name."""
    found = {v.name: v for v in [FULL, *perplexity_variants(), *retrieval_variants()]}
    if name not in found:
        raise KeyError(f"no quality variant {name!r}; known: {', '.join(found)}")
    return found[name]
