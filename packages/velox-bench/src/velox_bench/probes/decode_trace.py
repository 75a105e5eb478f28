"""The runtime trace of one decode step: the Python calls a step makes into the project's packages
and the modules one layer's share of them walks through (issue 47).

    python -m velox_bench.probes.decode_trace [--method tova,h2o,streaming_llm] [--budget 64]
        [--prompt-tokens 200] [--warmup 3] [--layer 0] [--functions] [--json out.json]

For each method: load the embedded SmolLM2-135M (30 layers, float32), build its Velox caches
(``velox_bench.models.make_caches``: ``KVCacheBuilder.for_model``, attention hook installed),
prefill a prompt of random token ids (seed 0) and end it, run ``--warmup`` decode steps, then
trace exactly one decode step with ``sys.setprofile``. The traced region is what mlx-lm's
generate loop does per token::

    logits = model(y, cache=caches); y = mx.argmax(logits[:, -1:], axis=-1); mx.eval(y)

``mx.eval(y)`` is inside the region; the calls made while it runs are counted apart
(``eval_calls``, 0 today: the compiled kernels were traced in the warm-up, evaluating runs no
Python). The caches' ``state`` (the saved form, which the generate loop never builds) is not
read inside or between the traced step and its warm-ups.

Definitions (chosen so that today's code reproduces issue 47's baseline: TOVA, budget 64, a
200-token prompt: 931 calls a step; layer 0's share enters 6 modules 14 times with 8 returns):

- **project module**: a module whose name starts with ``velox_cache_core``, ``velox_mlx_lm`` or
  ``velox_blas``.
- **project calls per step** (``calls``): the ``'call'`` profile events (Python functions,
  comprehensions included; C functions are ``'c_call'`` and not counted) whose frame runs in a
  project module, over the whole traced region, every layer.
- **entry**: a project call whose caller runs in a different module (non-project code or
  another project module). A call inside the module the caller runs in (``Layer.lay_out`` ->
  ``Layer._fits``) is no entry; returns are no entries either.
- **a layer's share**: the step's project calls split at each *outermost* project call (one
  made with no project frame on the stack: mlx-lm calling ``cache.offset``,
  ``cache.update_and_fetch``, ``cache.make_mask``, the attention hook); each such call and
  everything the project runs under it, until the next outermost call, goes to the layer whose
  cache object is among that call's arguments (``self`` included: ``cache.offset``; the hook's
  ``cache=``). Layer 0's share therefore holds ``make_mask``, which mlx-lm asks of the first
  layer's cache once per forward pass (the mask every layer shares), besides its two ``offset``
  reads, ``update_and_fetch`` and its attention call. An outermost call with no cache among its
  arguments goes to an ``unattributed`` share (none today).
- **modules entered** (``entries``): the sequence of the modules of a share's entries, in
  order; ``distinct`` is how many different modules that is.
- **returns to a module already left** (``returns``): walking that sequence, the entries into a
  module that appears earlier in it. Every entry is a new stay (an entry's caller runs
  elsewhere), so a module met again was left in between: ``cache, layer, cache`` is 1 return,
  ``cache, layer, fast_step, hook, cache, base, layer`` is 2.

Prints one row per method: calls a step, and for ``--layer`` (default 0): distinct modules,
entries and returns, then the fewest-most returns of any layer and the share's module sequence;
``--functions`` adds the calls per step of every project function. ``--json PATH`` writes every
figure (and the per-function counts) there.
"""

from __future__ import annotations

# velox_blas imports no mlx: OpenBLAS (Linux, when present) is loaded before mlx below.
from velox_blas import preload_openblas

BLAS = preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from types import FrameType  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from velox_bench.models import make_caches, prefill  # noqa: E402

__all__ = [
    "DEFAULT_METHODS",
    "PROJECT_PACKAGES",
    "LayerShare",
    "StepTrace",
    "function_table",
    "is_project",
    "main",
    "returns_to_left",
    "table",
    "trace_method",
    "trace_step",
]

PROJECT_PACKAGES = ("velox_cache_core", "velox_mlx_lm", "velox_blas")
DEFAULT_METHODS = ("tova", "h2o", "streaming_llm")
UNATTRIBUTED = -1  # the share of outermost calls with no cache among their arguments


def is_project(module: str) -> bool:
    """Whether ``module`` (a dotted name) belongs to one of :data:`PROJECT_PACKAGES`."""
    return module.split(".", 1)[0] in PROJECT_PACKAGES


def returns_to_left(modules: Sequence[str]) -> int:
    """Returns to a module already left: the entries in ``modules`` (a sequence of module
    entries, each a new stay) into a module that appears earlier in the sequence."""
    seen: set[str] = set()
    returns = 0
    for module in modules:
        if module in seen:
            returns += 1
        seen.add(module)
    return returns


@dataclass(frozen=True)
class _Call:
    """One ``'call'`` event into a project module."""

    module: str
    function: str
    entry: bool  # the caller runs in another module
    outermost: bool  # no project frame on the stack below it
    layer: int  # for an outermost call: the layer whose cache it was given (or UNATTRIBUTED)
    in_eval: bool  # made while ``mx.eval`` ran


@dataclass(frozen=True)
class LayerShare:
    """One layer's share of a step: its project calls and the modules its entries enter."""

    layer: int
    calls: int
    modules: tuple[str, ...]

    @property
    def entries(self) -> int:
        return len(self.modules)

    @property
    def distinct(self) -> int:
        return len(set(self.modules))

    @property
    def returns(self) -> int:
        return returns_to_left(self.modules)

    def as_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "calls": self.calls,
            "distinct_modules": self.distinct,
            "entries": self.entries,
            "returns": self.returns,
            "modules": list(self.modules),
        }


@dataclass(frozen=True)
class StepTrace:
    """One traced decode step: ``calls`` project calls (``eval_calls`` of them inside
    ``mx.eval``), per project function (``"module:qualname"``), and the per-layer shares
    (``shares[i]`` is layer ``i``'s; ``unattributed`` the rest, if any)."""

    calls: int
    eval_calls: int
    functions: dict[str, int]
    shares: list[LayerShare]
    unattributed: LayerShare | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def share(self, layer: int) -> LayerShare:
        return self.shares[layer]

    @property
    def max_returns(self) -> int:
        return max((s.returns for s in self.shares), default=0)

    def as_dict(self, layer: int = 0) -> dict[str, Any]:
        return {
            **self.settings,
            "calls_per_step": self.calls,
            "eval_calls": self.eval_calls,
            "layer": self.share(layer).as_dict(),
            "max_returns_any_layer": self.max_returns,
            "returns_per_layer": [s.returns for s in self.shares],
            "entries_per_layer": [s.entries for s in self.shares],
            "calls_per_layer": [s.calls for s in self.shares],
            "unattributed": None if self.unattributed is None else self.unattributed.as_dict(),
            "functions": self.functions,
        }


def _module_of(frame: FrameType | None) -> str:
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


def _project_below(frame: FrameType | None) -> bool:
    while frame is not None:
        if is_project(_module_of(frame)):
            return True
        frame = frame.f_back
    return False


def _layer_of(frame: FrameType, layers: dict[int, int]) -> int:
    for value in frame.f_locals.values():  # at a 'call' event: the arguments, self included
        if id(value) in layers:
            return layers[id(value)]
    return UNATTRIBUTED


def _recorder(
    record: list[_Call], layers: dict[int, int], in_eval: list[bool]
) -> Callable[[FrameType, str, Any], None]:
    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module_of(frame)
        if not is_project(module):
            return
        caller = frame.f_back
        caller_module = _module_of(caller)
        outermost = not is_project(caller_module) and not _project_below(caller)
        code = frame.f_code
        record.append(
            _Call(
                module=module,
                function=getattr(code, "co_qualname", code.co_name),
                entry=caller_module != module,
                outermost=outermost,
                layer=_layer_of(frame, layers) if outermost else UNATTRIBUTED,
                in_eval=in_eval[0],
            )
        )

    return profile


def _shares(record: Sequence[_Call], n_layers: int) -> tuple[list[LayerShare], LayerShare | None]:
    calls: dict[int, int] = {}
    modules: dict[int, list[str]] = {}
    current = UNATTRIBUTED
    for call in record:
        if call.outermost:
            current = call.layer
        calls[current] = calls.get(current, 0) + 1
        if call.entry:
            modules.setdefault(current, []).append(call.module)
    shares = [LayerShare(i, calls.get(i, 0), tuple(modules.get(i, ()))) for i in range(n_layers)]
    rest = None
    if UNATTRIBUTED in calls:
        rest = LayerShare(UNATTRIBUTED, calls[UNATTRIBUTED], tuple(modules.get(UNATTRIBUTED, ())))
    return shares, rest


def _step(model: nn.Module, caches: list[Any], y: mx.array) -> mx.array:
    y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
    mx.eval(y)
    return y


def trace_step(model: nn.Module, caches: list[Any], y: mx.array) -> tuple[StepTrace, mx.array]:
    """Trace one decode step from token ``y`` [1, 1] (forward, argmax, ``mx.eval``); return the
    trace and the next token."""
    record: list[_Call] = []
    in_eval = [False]
    layers = {id(c): i for i, c in enumerate(caches)}
    profile = _recorder(record, layers, in_eval)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        in_eval[0] = True
        mx.eval(y)
    finally:
        sys.setprofile(previous)
    shares, rest = _shares(record, len(caches))
    functions = Counter(f"{c.module}:{c.function}" for c in record)
    trace = StepTrace(
        calls=len(record),
        eval_calls=sum(c.in_eval for c in record),
        functions=dict(functions.most_common()),
        shares=shares,
        unattributed=rest,
    )
    return trace, y


def trace_method(
    model: nn.Module, method: str, budget: int = 64, prompt_tokens: int = 200, warmup: int = 3
) -> StepTrace:
    """Build ``method``'s caches at ``budget`` for ``model``, prefill ``prompt_tokens`` random
    token ids (seed 0) and end the prompt, run ``warmup`` decode steps, then trace one."""
    caches = make_caches(model, method, budget)
    vocab = int(model.args.vocab_size)
    prompt = mx.random.randint(0, min(vocab, 2000), (1, prompt_tokens), key=mx.random.key(0))
    y = prefill(model, caches, prompt)
    for _ in range(warmup):
        y = _step(model, caches, y)
    trace, _ = trace_step(model, caches, y)
    settings = {
        "method": method,
        "budget": budget,
        "prompt_tokens": prompt_tokens,
        "warmup": warmup,
        "layers": len(caches),
    }
    return replace(trace, settings=settings)


def _short(module: str) -> str:
    return module.split(".", 1)[1] if "." in module else module


def table(traces: Sequence[StepTrace], layer: int = 0) -> str:
    """The per-method table: calls a step and ``layer``'s share (modules, entries, returns)."""
    head = (
        f"{'method':<16}{'calls/step':>11}{'in eval':>8}{'modules':>9}{'entries':>9}"
        f"{'returns':>9}{'returns, all layers':>21}"
    )
    lines = [f"layer {layer}'s share: modules, entries, returns; then every layer's returns", head]
    for t in traces:
        s = t.share(layer)
        every = [x.returns for x in t.shares]
        spread = f"{min(every)}-{max(every)}" if every else "-"
        lines.append(
            f"{t.settings.get('method', '?'):<16}{t.calls:>11}{t.eval_calls:>8}"
            f"{s.distinct:>9}{s.entries:>9}{s.returns:>9}{spread:>21}"
        )
    for t in traces:
        s = t.share(layer)
        lines.append(
            f"{t.settings.get('method', '?')}, layer {layer}: "
            + " > ".join(_short(m) for m in s.modules)
        )
    return "\n".join(lines)


def function_table(trace: StepTrace) -> str:
    lines = [f"{trace.settings.get('method', '?')}: calls per step, per project function"]
    lines += [f"{n:>6}  {name}" for name, n in trace.functions.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--method", default=",".join(DEFAULT_METHODS), help="comma-separated")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3, help="decode steps before the traced one")
    parser.add_argument("--layer", type=int, default=0, help="the layer whose share is shown")
    parser.add_argument("--functions", action="store_true", help="calls per project function")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from velox_mlx_lm.embedded import load_default

    model = load_default()[0]
    if not 0 <= args.layer < len(model.layers):
        parser.error(f"--layer must be in [0, {len(model.layers)})")
    traces = [
        trace_method(model, m, args.budget, args.prompt_tokens, args.warmup)
        for m in args.method.split(",")
    ]
    print(
        f"BLAS: {BLAS}; embedded SmolLM2-135M ({len(model.layers)} layers), budget "
        f"{args.budget}, {args.prompt_tokens}-token prompt, {args.warmup} warm-up steps"
    )
    print(table(traces, args.layer))
    if args.functions:
        for t in traces:
            print(function_table(t))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"blas": BLAS, "runs": [t.as_dict(args.layer) for t in traces]}
        path.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
