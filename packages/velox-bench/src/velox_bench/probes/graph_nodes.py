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

Last, for each method whose decode step is one compiled call (through mlx-lm's cache and the
hook, the write deferred into the decision: :mod:`velox_cache_core.decode`): the host time of
one layer's decode call, of the compiled call inside it (timed where it runs, ``--steps`` real
steps) and the nodes that compiled call builds: how much of a layer's host time is the
kernel's graph and how much the Python around it.

    python -m velox_bench.probes.graph_nodes [--methods tova,h2o,streaming_llm,snapkv,morphkv]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.probes import layer_host_compare as lhc  # noqa: E402 (the layer, its inputs)
from velox_cache_core.decode import Evicting  # noqa: E402

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


def kernel_share(method: str, rng: np.random.Generator, steps: int) -> tuple[float, float, int]:
    """(host us of one layer's decode call, host us of the compiled call inside it, the nodes
    that call builds): medians over ``steps`` real decode steps of ``method`` through mlx-lm's
    cache and the hook (its write deferred into the decision), the compiled call timed where
    it runs. ``ValueError`` when the method's step is not one compiled decision call here."""
    subject = lhc._Subject(method, rng, through_cache=True)
    for _ in range(2):  # the cache has learned to defer its writes: the steady kernel is built
        k, v, q = lhc._draw(rng, 1), lhc._draw(rng, 1), lhc._draw(rng, 1, lhc.HQ)
        mx.eval(subject.call(k, v, q))
        subject.flush()
    hot = subject.layer.hot
    if not isinstance(hot, Evicting):  # off the path, or appending (SnapKV after its cut)
        raise ValueError(f"{method} decides nothing on the decode path here")
    inside: list[float] = []
    outputs: list[Any] = []
    decide = hot.kernels.decide  # shared by every layer of this key: put back below
    originals = dict(decide)
    for key, (kernel, record) in originals.items():

        def timed(*args: Any, _kernel: Any = kernel) -> Any:
            start = time.perf_counter()
            out = _kernel(*args)
            inside.append(time.perf_counter() - start)
            outputs[:] = [out]
            return out

        decide[key] = (timed, record)
    whole: list[float] = []
    nodes = 0
    try:
        for i in range(steps):
            seconds, out = _timed_step(subject, rng)
            whole.append(seconds)
            if i == 0:
                if not outputs:
                    raise ValueError(f"{method}: no compiled decision call was made")
                nodes = count_nodes(list(_leaves(outputs[0])))
            mx.eval(out)
            subject.flush()
    finally:
        decide.update(originals)  # the timed wrappers out again (a kernel built since stays)
    if len(inside) != steps:
        raise ValueError(f"{method}: {len(inside)} compiled calls in {steps} steps")
    return statistics.median(whole) * 1e6, statistics.median(inside) * 1e6, nodes


def full_call(rng: np.random.Generator, steps: int) -> float:
    """Host us of one layer's decode call with mlx-lm's ``KVCache`` (its update, then SDPA),
    timed as :func:`kernel_share` times a Velox layer's (median of ``steps``)."""
    subject = lhc._Subject("KVCache", rng)
    whole = []
    for _ in range(steps):
        seconds, out = _timed_step(subject, rng)
        whole.append(seconds)
        mx.eval(out)
        subject.flush()
        subject.trim(1)  # the store stays at the prompt's size
    return statistics.median(whole) * 1e6


def _timed_step(subject: lhc._Subject, rng: np.random.Generator) -> tuple[float, mx.array]:
    """One decode call of ``subject`` on new inputs (evaluated first): its host seconds and
    its output (not evaluated)."""
    k, v, q = lhc._draw(rng, 1), lhc._draw(rng, 1), lhc._draw(rng, 1, lhc.HQ)
    mx.eval(k, v, q)
    start = time.perf_counter()
    out = subject.call(k, v, q)
    return time.perf_counter() - start, out


def _leaves(tree: Any) -> Iterator[mx.array]:
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _leaves(item)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--methods", default="tova,h2o,streaming_llm,snapkv,morphkv")
    parser.add_argument("--chain", type=int, default=200, help="nodes in the timed chain")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=1000, help="decode steps timed per method")
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
    print("one layer's decode call through mlx-lm's cache, host us (medians): the whole call,")
    print("the compiled decision call inside it, and the nodes that call builds")
    print(f"{'cache':<14} {'layer':>7} {'compiled':>9} {'share':>6} {'nodes':>6}")
    print(f"{'KVCache':<14} {full_call(rng, args.steps):7.1f} {'-':>9} {'-':>6} {'-':>6}")
    for name in args.methods.split(","):
        try:
            whole, inside, nodes = kernel_share(name, rng, args.steps)
        except ValueError as err:
            print(f"{name:<14} (not one compiled call: {err})")
            continue
        print(f"{name:<14} {whole:7.1f} {inside:9.1f} {inside / whole:6.2f} {nodes:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
