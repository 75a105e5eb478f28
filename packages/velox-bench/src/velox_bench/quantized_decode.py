"""One layer's decode step with quantized rows: a Velox cache against mlx-lm's
``QuantizedKVCache`` plus its quantized attention, at the same bit width (issue 30).

Each subject holds one layer filled with ``context`` tokens; ``step()`` feeds one token (keys,
values and the true queries), attends, and evaluates the output and the cache state.

- ``velox``: TOVA at ``budget`` with ``kv_bits`` rows, keys in ``layout``
  (``velox_cache_core.layer.Layer``): the new token is quantized and written into the freed
  slot, the query's weights decide and attend. Past the budget it holds ``budget`` rows
  whatever the context.
- ``mlx``: ``QuantizedKVCache.update_and_fetch`` then
  ``mlx_lm.models.base.quantized_scaled_dot_product_attention``, as mlx-lm runs it: over every
  token of the context.

:func:`compare` times them in alternation (rounds interleaved, so both see the same machine
load) and reports the medians and their ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache

from velox_cache_core import POLICIES
from velox_cache_core.layer import Layer
from velox_cache_core.store.token_rows import Quant

__all__ = ["Case", "compare", "make_step"]


@dataclass(frozen=True)
class Case:
    context: int  # tokens fed before the timed steps
    budget: int = 512
    bits: int = 4
    group: int = 64
    h_kv: int = 8
    h_q: int = 32
    d: int = 128
    layout: str = "token"  # Velox's kv_key_layout (mlx-lm quantizes keys per token)


def _tokens(case: Case, n: int, seed: int) -> tuple[mx.array, mx.array]:
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    keys = mx.random.normal((1, case.h_kv, n, case.d), key=k1)
    queries = mx.random.normal((1, case.h_q, n, case.d), key=k2)
    return keys, queries


def make_step(kind: str, case: Case) -> Callable[[], None]:
    """A prepared subject's timed step (``kind``: ``velox`` or ``mlx``)."""
    keys, queries = _tokens(case, case.context, 0)
    new_k, new_q = _tokens(case, 1, 1)
    scale = case.d**-0.5
    mx.eval(keys, queries, new_k, new_q)
    if kind == "velox":
        policy = POLICIES["tova"]
        layer = Layer(
            policy,
            policy.init(budget=case.budget),
            None,
            quant=Quant(case.bits, case.group, case.layout),
        )
        for start in range(0, case.context, 256):
            part = slice(start, start + 256)
            layer.lay_out(keys[:, :, part], keys[:, :, part])
            mx.eval(layer.attend(queries[:, :, part], scale), layer.state.slots.arrays())

        def velox() -> None:
            layer.lay_out(new_k, new_k)
            out = layer.attend(new_q, scale)
            mx.eval(out, layer.state.slots.arrays())

        return velox
    cache = QuantizedKVCache(group_size=case.group, bits=case.bits)
    for start in range(0, case.context, 256):
        part = slice(start, start + 256)
        cache.update_and_fetch(keys[:, :, part], keys[:, :, part])
        mx.eval(cache.state)

    def mlx() -> None:
        k, v = cache.update_and_fetch(new_k, new_k)
        out = quantized_scaled_dot_product_attention(
            new_q, k, v, scale=scale, mask=None, group_size=case.group, bits=case.bits
        )
        mx.eval(out, cache.state)

    return mlx


def compare(case: Case, rounds: int = 30, warmup: int = 3) -> dict[str, Any]:
    """Median seconds per step of each subject, timed in alternation, and velox / mlx."""
    steps = {kind: make_step(kind, case) for kind in ("velox", "mlx")}
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for r in range(warmup + rounds):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            if r >= warmup:
                times[kind].append(time.perf_counter() - start)
    medians = {kind: statistics.median(ts) for kind, ts in times.items()}
    return {
        "case": case.__dict__,
        "median_s": medians,
        "ratio": medians["velox"] / medians["mlx"],
        "rounds": rounds,
    }
