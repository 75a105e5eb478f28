"""How many graph nodes one layer's cache call adds, and what one node costs on this machine.

MLX turns every call into a graph of primitives (nodes) and evaluates it node by node. Each
node has a fixed cost when it is built (in a compiled function's replay too) and another when
it is evaluated, whatever its size; at a small model's shapes on the CPU that fixed cost is a
large part of a step. This counts the nodes that one layer's call adds: its attention output,
the store and the undo log it leaves, from inputs that are already evaluated. The layer has the
embedded model's shape (3 KV / 9 query heads, head_dim 64, float32), holds a 600-token prompt
at budget 256 with the default undo log (16 tokens) and gets:

- decode: one token, ``lay_out`` then ``attend`` (mlx-lm's ``KVCache``: ``update_and_fetch``
  then ``mx.fast.scaled_dot_product_attention``);
- verify: a chunk of 4 tokens (a speculative round's verify chunk), then a trim of 3.

It then times compiled chains of ``--chain`` reshapes (nodes that copy nothing) against an
empty one: the build and evaluation time per node (medians of ``--reps`` calls). The last
columns multiply each cache's extra nodes over ``KVCache`` by those costs and by 30 layers
(the embedded model's depth).

    python -m velox_bench.probes.graph_nodes [--methods tova,h2o,streaming_llm,snapkv,morphkv]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import time
from collections.abc import Callable

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.probes import layer_host_compare as lhc  # noqa: E402 (the layer, its inputs)

LAYERS = 30  # the embedded model's depth
_NODE = re.compile(r"shape=rectangle")  # one per primitive in mx.export_to_dot's output


def count_nodes(arrays: list[mx.array]) -> int:
    """Primitives in the graph behind ``arrays`` (down to arrays already evaluated)."""
    buffer = io.StringIO()
    mx.export_to_dot(buffer, *arrays)
    return len(_NODE.findall(buffer.getvalue()))


def _left(subject: lhc._Subject) -> list[mx.array]:
    """What a call leaves besides its output: the store (and the undo log's arrays)."""
    if subject.full:
        return [subject.cache.keys, subject.cache.values]
    layer = subject.layer
    log = [] if layer.log is None else layer.log.arrays()
    return [*layer.state.slots.arrays(), *log]


def call_nodes(subject: lhc._Subject, rng: np.random.Generator, length: int) -> int:
    """Nodes of one call of ``length`` tokens (trimmed back to one token after, outside)."""
    k, v = lhc._draw(rng, length), lhc._draw(rng, length)
    q = lhc._draw(rng, length, lhc.HQ)
    mx.eval(k, v, q, _left(subject))
    out = subject.call(k, v, q)
    arrays = [out, *_left(subject)]
    nodes = count_nodes(arrays)
    mx.eval(arrays)
    if length > 1:
        subject.trim(length - 1)
        subject.flush()
    return nodes


def _chain(n: int) -> Callable[[mx.array], mx.array]:
    shapes = [(1, 3, 257 * 64), (1, 3, 257, 64)]

    def chain(x: mx.array) -> mx.array:
        for i in range(n):
            x = x.reshape(shapes[i % 2])
        return x.sum(axis=-1)

    return mx.compile(chain)


def node_cost(n: int, reps: int) -> tuple[float, float]:
    """(build, evaluate) microseconds per node: a compiled chain of ``n`` reshapes against an
    empty chain, medians of ``reps`` calls each, alternating."""
    x = mx.random.normal((1, 3, 257, 64))
    mx.eval(x)
    chains = {0: _chain(0), n: _chain(n)}
    times: dict[int, tuple[list[float], list[float]]] = {m: ([], []) for m in chains}
    for _ in range(reps):
        for m, fn in chains.items():
            start = time.perf_counter()
            y = fn(x)
            built = time.perf_counter()
            mx.eval(y)
            times[m][0].append(built - start)
            times[m][1].append(time.perf_counter() - built)
    build = [statistics.median(times[m][0]) for m in (0, n)]
    evaluate = [statistics.median(times[m][1]) for m in (0, n)]
    return (build[1] - build[0]) / n * 1e6, (evaluate[1] - evaluate[0]) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--methods", default="tova,h2o,streaming_llm,snapkv,morphkv")
    parser.add_argument("--chain", type=int, default=200, help="nodes in the timed chain")
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    counts = {}
    for name in ["KVCache", *args.methods.split(",")]:
        subject = lhc._Subject(name, rng)
        counts[name] = (call_nodes(subject, rng, 1), call_nodes(subject, rng, 4))
    build, evaluate = node_cost(args.chain, args.reps)
    print(f"BLAS: {lhc.BLAS}; one node: {build:.2f} us to build, {evaluate:.2f} us to evaluate")
    print(f"nodes one layer's call adds; extra over KVCache x {LAYERS} layers, at those costs")
    print(f"{'cache':<14} {'decode':>7} {'verify 4':>9} {'decode extra':>13} {'verify extra':>13}")
    base_decode, base_verify = counts["KVCache"]
    per_node_ms = (build + evaluate) * LAYERS / 1e3
    for name, (decode, verify) in counts.items():
        extra_decode = (decode - base_decode) * per_node_ms
        extra_verify = (verify - base_verify) * per_node_ms
        print(f"{name:<14} {decode:7d} {verify:9d} {extra_decode:10.2f} ms {extra_verify:10.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
