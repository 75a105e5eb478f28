"""Streaming perplexity: every token scored with the cache state decoding would have.

In sequential prefill a chunk is exactly equivalent to feeding its tokens one by one, so one
forward pass per chunk gives the per-token next-token log-likelihoods of a streaming decode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig


def token_nll(
    model: nn.Module,
    config: KVCacheConfig,
    tokens: Sequence[int],
    chunk: int = 256,
    on_chunk: Callable[[int], Any] | None = None,
    build: Callable[[], list[Any]] | None = None,
) -> np.ndarray:
    """Negative log-likelihood of ``tokens[1:]``, each given the tokens before it.

    ``tokens``: ``T + 1`` ids, fed in chunks of ``chunk`` tokens through one cache per layer.
    Returns float64 ``[T]``. ``on_chunk(n)`` is called after each chunk of ``n`` tokens.
    ``build()``: makes the caches (default: ``KVCacheBuilder.for_model(model, config)``).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    caches = KVCacheBuilder.for_model(model, config) if build is None else build()
    n = ids.shape[1] - 1
    out: list[np.ndarray] = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits = model(ids[:, start:stop], cache=caches)[0].astype(mx.float32)
        targets = ids[0, start + 1 : stop + 1]
        nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
            logits, targets[:, None], axis=-1
        ).squeeze(-1)
        mx.eval(nll, [c.state for c in caches])
        out.append(np.array(nll, dtype=np.float64))
        if on_chunk is not None:
            on_chunk(stop - start)
    return np.concatenate(out)


def perplexity(nll: np.ndarray) -> float:
    """``exp(mean NLL)`` over every scored token."""
    return math.exp(float(np.mean(nll)))
