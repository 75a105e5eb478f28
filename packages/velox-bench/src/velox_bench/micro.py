"""One layer's decode update, per method, in steady state at a fixed budget.

Each ``Subject`` holds a layer already filled to ``budget`` tokens; ``step()`` appends one token
and evaluates everything the step produced, cache state included. Velox states are replaced
before ``mx.eval`` so nothing references the old slots and MLX can write the new token in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_bench.variants import MLX_KVCACHE, MLX_ROTATING, SDPA, micro_variants
from velox_cache_core import KVSlots, Policy

__all__ = ["Subject", "make_subject", "state_arrays"]


def state_arrays(state: Any) -> list[mx.array]:
    """Every array a (possibly nested) policy state dataclass holds."""
    out: list[mx.array] = []
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, KVSlots):
            out += value.arrays()
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += state_arrays(value)
    return out


@dataclasses.dataclass
class Subject:
    """A layer ready for timed decode steps: ``step()`` (timed), ``reset()`` (untimed).

    ``grows``: the cache keeps every token after its prompt ends (SnapKV), so ``n_keys()`` rises
    by one per step above the budget.
    """

    step: Callable[[], None]
    reset: Callable[[], None] = lambda: None
    n_keys: Callable[[], int] = lambda: 0
    grows: bool = False


def _velox(
    policy: Policy, state: Any, k: mx.array, q: mx.array, prompt: tuple[mx.array, ...]
) -> Subject:
    pk, pq = prompt
    step = policy.update(state, keys=pk, values=pk, queries=pq, check_finite=False)
    box = [policy.end_prompt(step.state)]  # SnapKV cuts its prompt here; a no-op elsewhere
    del step
    mx.eval(*state_arrays(box[0]))

    def run() -> None:
        s = policy.update(box[0], keys=k, values=k, queries=q, check_finite=False)
        box[0] = s.state  # the old state is dropped before eval: in-place slot writes
        arrays = [s.keys, s.values, *state_arrays(box[0])]
        if s.mask is not None:
            arrays.append(s.mask)
        del s
        mx.eval(*arrays)

    run()  # first eviction: the store reaches its steady shape (budget + 1 slots)
    return Subject(run, n_keys=lambda: int(box[0].n_kept), grows=policy.grows_after_prompt_end)


def make_subject(method: str, budget: int, h_kv: int, h_q: int, d: int) -> Subject:
    """Build ``method``'s layer (one of ``velox_bench.variants.micro_methods()``) at ``budget``
    tokens for heads ``h_kv``/``h_q``, dim ``d``."""
    mx.random.seed(0)
    variant = {v.name: v for v in micro_variants()}.get(method)
    policy = None if variant is None else variant.policy
    # A policy with a prompt end (SnapKV) compresses a prompt longer than its budget.
    n_prompt = 2 * budget if policy is not None and policy.prompt_end is not None else budget
    pk = mx.random.normal((1, h_kv, n_prompt, d))
    pq = mx.random.normal((1, h_q, n_prompt, d))
    k = mx.random.normal((1, h_kv, 1, d))
    q = mx.random.normal((1, h_q, 1, d))
    mx.eval(pk, pq, k, q)
    prompt = (pk, pq)
    if variant is not None and policy is not None:
        # Random rows come from no model: a policy that un-rotates its queries by the model's
        # RoPE (which the builder reads off a model) turns them by mlx's default one.
        rope = {f"{policy.name}_rope_base": 1e4} if "rope_base" in policy.setting_names else {}
        return _velox(policy, variant.config(budget, **rope).state(), k, q, prompt)
    if method == MLX_KVCACHE:
        cache = KVCache()
        mx.eval(cache.update_and_fetch(pk, pk))

        def append() -> None:
            keys, values = cache.update_and_fetch(k, k)
            mx.eval(keys, values, cache.keys, cache.values)

        def trim() -> None:  # keep the comparison at `budget` tokens
            if cache.offset > budget:
                cache.trim(cache.offset - budget)

        return Subject(append, reset=trim, n_keys=lambda: int(cache.offset))
    if method == MLX_ROTATING:
        rotating = RotatingKVCache(max_size=budget, keep=4)
        mx.eval(rotating.update_and_fetch(pk, pk))

        def rotate() -> None:
            keys, values = rotating.update_and_fetch(k, k)
            mx.eval(keys, values, rotating.keys, rotating.values)

        rotate()
        return Subject(rotate, n_keys=lambda: int(rotating.size()))
    if method == SDPA:  # the yardstick: one query attending to budget + 1 keys
        keys = mx.random.normal((1, h_kv, budget + 1, d))
        values = mx.random.normal((1, h_kv, budget + 1, d))
        mx.eval(keys, values)
        scale = d**-0.5

        def attend() -> None:
            mx.eval(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale))

        return Subject(attend, n_keys=lambda: budget + 1)
    raise ValueError(f"unknown micro method {method!r}")
