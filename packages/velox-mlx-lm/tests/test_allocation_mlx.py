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


@pytest.mark.parametrize("mode", ["head", "global"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_adaptive_allocation_generates_within_the_uniform_bytes(
    tiny_model: Any, tmp_path: Path, name: str, mode: str
) -> None:
    model = tiny_model("llama")
    prompt = np.random.default_rng(0).integers(2, 128, 80).tolist()
    settings = dict(CASES[name])
    policy = POLICY.get(name, name)
    uniform = KVCacheBuilder.for_model(model, KVCacheConfig(**settings))
    adaptive = KVCacheBuilder.for_model(
        model, KVCacheConfig(**settings, **{f"{policy}_allocation": mode})
    )
    _generate(model, uniform, prompt, 6)
    tokens = _generate(model, adaptive, prompt, 6)
    assert len(tokens) == 6
    for u, a in zip(uniform, adaptive, strict=True):
        state = a.policy_state
        assert state.lanes is not None and state.lanes.free is not None
        assert a.offset == u.offset > 80
        if mode == "head":
            assert a.nbytes <= u.nbytes
    if mode == "global":  # the model's rows: those of the uniform cut, shared across layers
        assert sum(a.nbytes for a in adaptive) <= sum(u.nbytes for u in uniform)
    heads = int(adaptive[0].policy_state.slots.keys.shape[1])
    counts = {n for a in adaptive for n in a.policy_state.lanes.counts(heads)[0].tolist()}
    assert len(counts) > 1  # the heads (and layers) keep different counts
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


def _held_prompt(model: Any, allocation: str, seed: int) -> list[Any]:
    """TOVA caches (scope head, ``allocation``) after a 60-token prompt in one call: held
    whole for the cut that the next single token makes."""
    prompt = np.random.default_rng(seed).integers(2, 128, 60).tolist()
    config = KVCacheConfig(**CASES["tova"], tova_allocation=allocation)
    caches = KVCacheBuilder.for_model(model, config)
    model(mx.array(prompt)[None], cache=caches)
    mx.eval([c.state for c in caches])
    assert caches[0].policy_state.holds_prompt
    return caches


def test_a_held_prompt_round_trips_before_its_cut(tiny_model: Any) -> None:
    """A prompt cache saved while TOVA holds its prompt for the cut (more rows than budget)
    loads, and cuts at the next single token as the original would."""
    from mlx_lm.models.cache import KVCache  # noqa: F401  (mlx-lm's cache module is loaded)

    model = tiny_model("llama")
    caches = _held_prompt(model, "head", seed=1)
    assert caches[0].size() == 60
    copies = [type(c).from_state(c.state) for c in caches]
    assert _generate(model, copies, [7], 3) == _generate(model, caches, [7], 3)


def test_snapkv_global_generates_and_round_trips(tiny_model: Any, tmp_path: Path) -> None:
    """SnapKV with a model-wide allocation: the prompt's end cuts every layer together (layers
    keep different counts, the model the uniform cut's bytes); a prompt cache saved and
    loaded with velox_mlx_lm.load_prompt_cache generates as the original."""
    from velox_mlx_lm import load_prompt_cache as velox_load

    model = tiny_model("llama")
    prompt = np.random.default_rng(2).integers(2, 128, 80).tolist()
    base = {"method": "snapkv", "snapkv_budget": 16, "snapkv_window": 4}
    uniform = KVCacheBuilder.for_model(model, KVCacheConfig(**base))
    shared = KVCacheBuilder.for_model(model, KVCacheConfig(**base, snapkv_allocation="global"))
    _generate(model, uniform, prompt, 4)
    _generate(model, shared, prompt, 4)
    assert len({c.policy_state.lanes.n_lanes for c in shared}) > 1
    assert sum(c.nbytes for c in shared) <= sum(c.nbytes for c in uniform)
    path = str(tmp_path / "snap.safetensors")
    save_prompt_cache(path, shared)
    loaded = velox_load(path)
    follow = [5, 9, 17]
    assert _generate(model, loaded, follow, 3) == _generate(model, shared, follow, 3)


def test_a_held_prompt_under_global_relinks_when_loaded(tiny_model: Any, tmp_path: Path) -> None:
    """A TOVA cache saved while it holds its prompt for the model-wide cut loads linked again
    (velox_mlx_lm.load_prompt_cache) and cuts as the original does; mlx-lm's own loader gives
    unlinked caches, which refuse the cut with the reason."""
    from velox_mlx_lm import load_prompt_cache as velox_load

    model = tiny_model("llama")
    caches = _held_prompt(model, "global", seed=3)
    path = str(tmp_path / "held.safetensors")
    save_prompt_cache(path, caches)
    relinked = velox_load(path)
    assert _generate(model, relinked, [7], 3) == _generate(model, caches, [7], 3)
    with pytest.raises(ValueError, match="not linked to the others"):
        _generate(model, load_prompt_cache(path), [7], 1)


def test_speculative_decoding_over_a_held_prompt_is_refused(tiny_model: Any) -> None:
    """mlx-lm's speculative loop never feeds the main model a single token, so TOVA's held
    prompt would never be cut: its first trim says so instead of letting the cache grow."""
    from mlx_lm.generate import speculative_generate_step

    model = tiny_model("llama")
    prompt = mx.array(np.random.default_rng(4).integers(2, 128, 60).tolist())
    config = KVCacheConfig(**CASES["tova"], tova_allocation="head")
    caches = KVCacheBuilder.for_model(model, config) + KVCacheBuilder.for_model(model, config)
    steps = speculative_generate_step(
        prompt, model, model, prompt_cache=caches, max_tokens=4, num_draft_tokens=2
    )
    with pytest.raises(ValueError, match="would grow without bound"):
        list(steps)
