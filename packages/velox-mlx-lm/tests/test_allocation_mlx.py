"""Adaptive allocation end to end on tiny mlx-lm models: TOVA, H2O (scope head) and Expected
Attention with
``allocation="head"`` generate through the hook, hold no more bytes than the uniform cut,
and survive a prompt-cache round trip (lanes, dead rows and sums included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

CASES = {
    "tova": {"method": "tova", "tova_scope": "head", "tova_budget": 16},
    "tova_adapted": {"method": "tova_adapted", "tova_budget": 16},
    "h2o": {"method": "h2o", "h2o_budget": 16, "h2o_recent": 4},
    "expected_attention": {
        "method": "expected_attention",
        "expected_attention_budget": 16,
        "expected_attention_recent": 4,
        "expected_attention_refresh_every": 3,  # refreshes among the tokens generated
    },
}
POLICY = {"tova": "tova", "tova_adapted": "tova", "h2o": "h2o"}


def _generate(model: Any, caches: list[Any], prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("name", sorted(CASES))
def test_head_allocation_generates_within_the_uniform_bytes(
    tiny_model: Any, tmp_path: Path, name: str
) -> None:
    model = tiny_model("llama")
    prompt = np.random.default_rng(0).integers(2, 128, 80).tolist()
    settings = dict(CASES[name])
    policy = POLICY.get(name, name)
    uniform = KVCacheBuilder.for_model(model, KVCacheConfig(**settings))
    adaptive = KVCacheBuilder.for_model(
        model, KVCacheConfig(**settings, **{f"{policy}_allocation": "head"})
    )
    _generate(model, uniform, prompt, 6)
    tokens = _generate(model, adaptive, prompt, 6)
    assert len(tokens) == 6
    for u, a in zip(uniform, adaptive, strict=True):
        state = a.policy_state
        assert state.lanes is not None and state.lanes.free is not None
        assert a.offset == u.offset > 80
        assert a.nbytes <= u.nbytes
    # a prompt-cache round trip keeps the lanes, their dead rows and running sums
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, adaptive)
    loaded = load_prompt_cache(path)
    for a, b in zip(adaptive, loaded, strict=True):
        la, lb = a.policy_state.lanes, b.policy_state.lanes
        assert mx.array_equal(la.positions, lb.positions) and mx.array_equal(la.free, lb.free)
        assert (la.scores is None) == (lb.scores is None)
    follow = [5, 9, 17]
    assert _generate(model, loaded, follow, 4) == _generate(model, adaptive, follow, 4)


def test_a_held_prompt_round_trips_before_its_cut(tiny_model: Any) -> None:
    """A prompt cache saved while TOVA holds its prompt for the cut (more rows than budget)
    loads, and cuts at the next single token as the original would."""
    from mlx_lm.models.cache import KVCache  # noqa: F401  (mlx-lm's cache module is loaded)

    model = tiny_model("llama")
    prompt = np.random.default_rng(1).integers(2, 128, 60).tolist()
    config = KVCacheConfig(**CASES["tova"], tova_allocation="head")
    caches = KVCacheBuilder.for_model(model, config)
    model(mx.array(prompt)[None], cache=caches)
    mx.eval([c.state for c in caches])
    assert caches[0].policy_state.holds_prompt and caches[0].size() == 60
    copies = [type(c).from_state(c.state) for c in caches]
    assert _generate(model, copies, [7], 3) == _generate(model, caches, [7], 3)
