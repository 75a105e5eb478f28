"""Adding a policy is one core module, one reference check and one registry line.

A toy policy (``knorm``: evict the key with the largest L2 norm, a query-free rule in the spirit
of kvpress's ``KnormPress``) is written here as a policy module would be, registered at test
time, and then driven through everything users touch without any other edit: ``KVCacheConfig``,
``KVCacheBuilder.for_model``, generation on a tiny mlx-lm model, prompt-cache save/load and
``velox-generate --method``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_cache_core import Call, Decision, KVSlots, Policy, PolicyState, register, running
from velox_cache_core.registry import unregister
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.validation import check_budget_and_sinks
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, cache_class, cli, methods

# -- the policy module (what policies/knorm.py would hold) --------------------------------------


@dataclass(frozen=True, kw_only=True)
class KnormState(PolicyState):
    budget: int
    n_sink: int
    evicted: int = running(0)  # running state: tokens dropped so far, per (row, head)


def init_knorm_state(budget: int = 512, n_sink: int = 4) -> KnormState:
    check_budget_and_sinks(budget, n_sink)
    return KnormState(budget=budget, n_sink=n_sink)


def knorm_rule(state: KnormState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Drop the largest-norm keys (sinks kept; ties lose the oldest)."""
    n = candidates.n_slots
    if n <= state.budget:
        return Decision(candidates)
    score = -mx.sqrt((candidates.keys.astype(mx.float32) ** 2).sum(axis=-1))
    positions = candidates.positions
    protected = sinks(positions, state.n_sink)
    if call.length == 1:
        kept = candidates.with_free(lowest_weight(score, positions, protected))
    else:
        kept = candidates.take(highest_weights(score, positions, protected, state.budget))
    return Decision(kept, changes={"evicted": state.evicted + n - state.budget})


KNORM = Policy("knorm", KnormState, init_knorm_state, knorm_rule, uses_queries=False)


# -- the reference (what the core's contract matrix entry would hold) ---------------------------


def knorm_reference(keys: np.ndarray, budget: int, n_sink: int) -> list[list[int]]:
    """Token by token: kept positions per head after the whole stream. keys ``[H, T, D]``."""
    out = []
    for head in keys:
        kept: list[int] = []
        for t in range(head.shape[0]):
            kept.append(t)
            if len(kept) > budget:
                norms = {p: float(np.linalg.norm(head[p])) for p in kept if p >= n_sink}
                worst = max(norms.values())
                kept.remove(min(p for p, v in norms.items() if v == worst))
        out.append(sorted(kept))
    return out


@pytest.fixture
def knorm() -> Iterator[Policy]:
    register(KNORM)
    yield KNORM
    unregister("knorm")


def _kept(cache: Any) -> list[list[int]]:
    return [sorted(row) for row in np.array(cache.positions)[0].tolist()]


def test_reference_agreement_any_chunking(knorm: Policy) -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 2, 23, 4)).astype(np.float32)
    want = knorm_reference(keys[0], budget=6, n_sink=1)
    for sizes in ([23], [1] * 23, [5, 1, 9, 1, 7]):
        state, start = knorm.init(budget=6, n_sink=1), 0
        for size in sizes:
            k = mx.array(keys[:, :, start : start + size])
            state = knorm.update(state, k, k).state
            start += size
        assert [sorted(r) for r in np.array(state.positions)[0].tolist()] == want
        assert state.evicted == 23 - 6


def test_config_builder_generation_and_prompt_cache(
    knorm: Policy, tiny_model: Any, h: Any, tmp_path: Path
) -> None:
    assert "knorm" in methods()
    config = KVCacheConfig(method="knorm", knorm_budget=8, knorm_n_sink=1)
    assert config.settings() == {"budget": 8, "n_sink": 1}
    with pytest.raises(ValueError, match="knorm_budget"):
        KVCacheConfig(method="knorm", knorm_budget=0)
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, config)
    assert all(type(c) is cache_class("knorm") for c in caches)
    prompt = h.random_tokens(20, seed=3)
    steps = generate_step(prompt[0], model, prompt_cache=caches, max_tokens=6)
    for _ in steps:
        assert all(c.size() <= 8 for c in caches)
    assert all(c.offset > 20 and c.policy_state.evicted == c.offset - 8 for c in caches)

    path = str(tmp_path / "knorm.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded, strict=True):
        assert type(b) is type(a) and b.settings == a.settings
        assert b.offset == a.offset and b.policy_state.evicted == a.policy_state.evicted
        assert _kept(b) == _kept(a)
        assert mx.array_equal(b.policy_state.keys, a.policy_state.keys)


@pytest.mark.model
def test_velox_generate_method(
    knorm: Policy, capsys: pytest.CaptureFixture[str], embedded_model_path: Any
) -> None:
    code = cli.main(
        [
            *("--prompt", "The capital of France is", "--max-tokens", "4"),
            *("--method", "knorm", "--budget", "6", "--json"),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == {"method": "knorm", "budget": 6, "n_sink": 4}
    assert report["runs"][0]["tokens_kept_per_layer"] == 6
