"""Host time of one layer's cache calls: what Python and graph building cost before MLX
evaluates anything (the part of a step a GPU cannot hide), Velox against mlx-lm's KVCache.

    python -m velox_bench.probes.layer_host_compare [--methods tova,h2o,streaming_llm] [--rounds 25]

One layer of the embedded model's shape (3 KV heads, 9 query heads, head_dim 64, float32) holds
a 600-token prompt at budget 256 with the default undo log (16 tokens). Timed, per call, with
the graph evaluated after each call outside the timed region (the layer's rows through
``Layer.arrays()``, which keeps a decoding layer on the decode path):

- decode: a 1-token ``lay_out`` + ``attend`` (the fast path), against ``KVCache``'s
  ``update_and_fetch`` + ``mx.fast.scaled_dot_product_attention``;
- verify: a 4-token chunk (a speculative round's verify chunk), against the same for KVCache;
- trim: taking back 3 of those 4 tokens, against ``KVCache.trim(3)``.

Prints the median over ``--rounds`` rounds of the median per call, in microseconds.

``--cache``: the Velox layers are mlx-lm caches (``PolicyKVCache``, the model's side of the
attention hook: ``update_and_fetch`` then the hook's ``scaled_dot_product_attention``), each
method twice: as the builder makes it for a model with a cache per layer (a decode step that
waits for its queries writes its token in ``attend``, one compiled call: ``Evicting.write``'s
``defer``), and ``<method> written`` with ``shared_rows`` on (the write kernel in
``update_and_fetch``, the decision in ``attend``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from velox_cache_core.layer import Layer, Mode  # noqa: E402
from velox_cache_core.registry import POLICIES  # noqa: E402
from velox_cache_core.undo import new_log  # noqa: E402
from velox_mlx_lm.cache import cache_class  # noqa: E402
from velox_mlx_lm.hook import velox_scaled_dot_product_attention  # noqa: E402

B, H, HQ, D, PROMPT, BUDGET, SCALE = 1, 3, 9, 64, 600, 256, 0.125


def _draw(rng: np.random.Generator, L: int, heads: int = H) -> mx.array:
    return mx.array(rng.standard_normal((B, heads, L, D)).astype(np.float32))


class _Subject:
    """A cache of one kind with its three timed calls."""

    def __init__(self, method: str, rng: np.random.Generator, through_cache: bool = False) -> None:
        k, v, q = _draw(rng, PROMPT), _draw(rng, PROMPT), _draw(rng, PROMPT, HQ)
        self.full = method == "KVCache"
        self.velox: Any = None  # the mlx-lm cache (through_cache)
        if self.full:
            self.cache: Any = KVCache()
            self.cache.update_and_fetch(k, v)
            mx.eval(self.cache.keys)
            return
        name, _, how = method.partition(" ")
        if through_cache:
            self.velox = cache_class(name)(budget=BUDGET)
            self.velox.shared_rows = how == "written"
            self.layer = self.velox.layer
            mx.eval(self._through_hook(k, v, q), self.layer.state)
        else:
            policy = POLICIES[name]
            self.layer = Layer(policy, policy.init(budget=BUDGET), new_log(16), mode=Mode.QUERIES)
            self.layer.lay_out(k, v)
            mx.eval(self.layer.attend(q, SCALE), self.layer.state)
        for _ in range(2):  # a steady store: every further step evicts
            self.call(_draw(rng, 1), _draw(rng, 1), _draw(rng, 1, HQ))
            self.flush()

    def call(self, k: mx.array, v: mx.array, q: mx.array) -> mx.array:
        if self.full:
            keys, values = self.cache.update_and_fetch(k, v)
            mask = "causal" if k.shape[2] > 1 else None
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE, mask=mask)
        if self.velox is not None:
            return self._through_hook(k, v, q)
        self.layer.lay_out(k, v)
        return self.layer.attend(q, SCALE)

    def _through_hook(self, k: mx.array, v: mx.array, q: mx.array) -> mx.array:
        """The model's side of a Velox cache: ``update_and_fetch``, then the hook with what
        it returned."""
        keys, values = self.velox.update_and_fetch(k, v)
        return velox_scaled_dot_product_attention(q, keys, values, self.velox, SCALE, None)

    def trim(self, n: int) -> None:
        if self.full:
            self.cache.trim(n)
        else:
            self.layer.trim(n)

    def flush(self) -> None:
        """Evaluate the rows between calls, as a generate loop's step does; for Velox through
        ``Layer.arrays()``, which leaves the decode path as it is (reading ``state`` would
        take the layer off it, so every timed call would pay the way back on)."""
        if self.full:
            mx.eval(self.cache.keys, self.cache.values)
        else:
            mx.eval(self.layer.arrays())


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _round(subject: _Subject, rng: np.random.Generator, calls: int) -> dict[str, float]:
    """Median seconds per decode call, verify chunk and trim over ``calls`` of each."""
    times: dict[str, list[float]] = {"decode": [], "verify": [], "trim": []}
    for _ in range(calls):
        k, v, q = _draw(rng, 1), _draw(rng, 1), _draw(rng, 1, HQ)
        mx.eval(k, v, q)
        seconds, out = _timed(lambda: subject.call(k, v, q))  # noqa: B023
        times["decode"].append(seconds)
        mx.eval(out)
        subject.flush()
    for _ in range(calls):
        k, v, q = _draw(rng, 4), _draw(rng, 4), _draw(rng, 4, HQ)
        mx.eval(k, v, q)
        seconds, out = _timed(lambda: subject.call(k, v, q))  # noqa: B023
        times["verify"].append(seconds)
        mx.eval(out)
        subject.flush()
        seconds, _ = _timed(lambda: subject.trim(3))
        times["trim"].append(seconds)
        subject.flush()
    return {part: statistics.median(ts) for part, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--methods", default="tova,h2o,streaming_llm")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per part and round")
    parser.add_argument(
        "--cache", action="store_true", help="through mlx-lm caches and the hook (see above)"
    )
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    methods = args.methods.split(",")
    if args.cache:
        methods = [name for m in methods for name in (m, f"{m} written")]
    names = ["KVCache", *methods]
    subjects = {name: _Subject(name, rng, args.cache) for name in names}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, subject in subjects.items():  # alternate: drifts hit every cache alike
            rounds[name].append(_round(subject, rng, args.calls))
    print(f"BLAS: {BLAS}; host us per call (median of {args.rounds} rounds)")
    print(f"{'cache':<20} {'decode':>8} {'verify 4':>9} {'trim 3':>8}")
    for name, rs in rounds.items():
        cells = [
            statistics.median(r[part] for r in rs) * 1e6 for part in ("decode", "verify", "trim")
        ]
        print(f"{name:<20} " + " ".join(f"{c:8.1f}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
