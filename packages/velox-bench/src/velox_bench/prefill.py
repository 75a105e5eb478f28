"""Synthetic TOVA prefill: a prompt fed in chunks, every chunk's output and state evaluated."""

from __future__ import annotations

import mlx.core as mx

from velox_bench.micro import state_arrays
from velox_cache_core import TovaState, init_tova_state, tova_update

__all__ = ["CHUNK", "random_prompt", "tova_prefill"]

CHUNK = 512  # prefill chunk (mlx-lm prefill_step_size: 2048 in generate_step, 512 speculative)


def random_prompt(
    seq_len: int, h_kv: int, h_q: int, d: int, seed: int = 0
) -> tuple[mx.array, mx.array, mx.array]:
    """Keys, values ``[1, h_kv, seq_len, d]`` and queries ``[1, h_q, seq_len, d]``, evaluated."""
    mx.random.seed(seed)
    keys = mx.random.normal((1, h_kv, seq_len, d))
    values = mx.random.normal((1, h_kv, seq_len, d))
    queries = mx.random.normal((1, h_q, seq_len, d))
    mx.eval(keys, values, queries)
    return keys, values, queries


def tova_prefill(
    keys: mx.array,
    values: mx.array,
    queries: mx.array,
    budget: int,
    n_sink: int,
    mode: str,
    chunk: int = CHUNK,
) -> TovaState:
    """Feed the prompt to a fresh TOVA state (signal query, scope layer) ``chunk`` at a time."""
    state = init_tova_state(budget=budget, n_sink=n_sink, prefill=mode)  # type: ignore[arg-type]
    for start in range(0, keys.shape[2], chunk):
        end = start + chunk
        step = tova_update(
            state,
            keys[:, :, start:end],
            values[:, :, start:end],
            queries[:, :, start:end],
            check_finite=False,
        )
        state = step.state
        arrays = [step.keys, step.values, *state_arrays(state)]
        if step.mask is not None:
            arrays.append(step.mask)
        del step
        mx.eval(*arrays)
    return state
