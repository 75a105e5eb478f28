"""Host and eval time of a decode step, per method, against mlx-lm's ``KVCache`` and
``RotatingKVCache``, side by side in one process.

A decode step as mlx-lm's generate loop runs it, split in two timed parts::

    t0; logits = model(y, cache=caches); y = mx.argmax(logits[:, -1:], axis=-1); t1
    mx.eval(y); t2

- host (``t1 - t0``): Python and graph building, before anything is evaluated;
- eval (``t2 - t1``): evaluating ``y``, which is what the generate loop evaluates; a cache's
  state arrays are computed there as far as ``y`` needs them.

Every ``flush_every`` steps the caches' state arrays (``[c.state for c in caches]``) are
evaluated outside the timed region, so lazy graphs cannot pile up; that time is reported apart
(``flush_ms`` per flush, ``flush_ms_per_step`` its sum over the timed steps per step). For a
Velox cache ``state`` is the saved form (``velox_mlx_lm.prompt_state``: the live rows compacted,
the undo log's arrays), built when it is read: most of the flush is building it, which the
generate loop never does. A decode step's own arrays (rows, dead slot, undo victims, H2O's sums)
are evaluated with ``y``.

Methods: mlx-lm's ``KVCache`` (``full``) and ``RotatingKVCache(max_size=budget, keep=4)``
(``rotating``), then every registered Velox method at ``budget``
(``velox_bench.variants.policy_variants``: methods whose prompt end is a model pass, KVzip,
are left out, as in every cache-only suite, and named under ``skipped``). Each method gets its
own cache list over the same random prompt (prefilled in chunks of 256). The rounds are
interleaved: each round runs ``warmup`` untimed and ``steps`` timed decode steps of every
method in turn, starting one method later each round, so that a noisy machine hits every
method alike; per method, the medians are over every timed step of every round.

Per method: median host ms, eval ms and total (host + eval) ms, their ratios to ``full`` and
the total's to ``rotating``, and for Velox caches the fraction of layers whose next decode step
takes the decode path (``velox_cache_core.decode``, ``Layer.fast_path``).

Models: ``smollm2`` (the embedded SmolLM2-135M-Instruct, float32, dequantized) and
``real-shape`` (a random 12-layer llama, hidden 768, 12 query / 4 KV heads, vocabulary 1024:
``test_decode_overhead``'s model; 2 layers and hidden 64 under ``VELOX_BENCH_SMOKE=1``).

    python -m velox_bench.decode_host --model smollm2 --context 700 --budget 512 \\
        --steps 30 --rounds 3

prints a table and writes ``benchmarks/results/decode_host.json`` (``--out`` elsewhere;
``VELOX_BENCH_RESULTS_DIR`` moves the results directory). ``VELOX_BENCH_SMOKE=1``: context 48,
budget 16, 3 steps, 1 round unless given.
"""

from __future__ import annotations

# Before mlx: OpenBLAS only takes effect when it is loaded first (a no-op when mlx already is).
from velox_blas import preload_openblas

preload_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from velox_bench.models import make_caches, prefill, random_llama  # noqa: E402
from velox_bench.results import machine_info, smoke, write_json  # noqa: E402
from velox_bench.variants import FULL, ROTATING, policy_variants  # noqa: E402
from velox_mlx_lm import PolicyKVCache  # noqa: E402
from velox_mlx_lm.config import methods as registered_methods  # noqa: E402

__all__ = [
    "MODELS",
    "SMOKE_SETTINGS",
    "Model",
    "Settings",
    "fast_path_fraction",
    "load_model",
    "main",
    "measure",
    "methods",
    "payload",
    "skipped_methods",
    "table",
]

SMOLLM2 = "smollm2"
REAL_SHAPE = "real-shape"
MODELS = (SMOLLM2, REAL_SHAPE)
REAL_SHAPE_ARGS: dict[str, int] = dict(
    layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=1024
)
SMOKE_SHAPE_ARGS: dict[str, int] = dict(
    layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=1024
)
SUITE = "decode_host"


@dataclass(frozen=True)
class Settings:
    """One measurement's sizes: prompt tokens, Velox/rotating budget, timed steps per round,
    rounds, untimed steps per round before the timed ones, steps between state flushes, and
    prefill chunk size."""

    context: int = 700
    budget: int = 512
    steps: int = 30
    rounds: int = 3
    warmup: int = 3
    flush_every: int = 8
    chunk: int = 256


SMOKE_SETTINGS = Settings(context=48, budget=16, steps=3, rounds=1, warmup=1)


@dataclass(frozen=True)
class Model:
    """A loaded model: the module, its vocabulary size and a description for the results."""

    name: str
    module: nn.Module
    vocab: int
    info: dict[str, Any]


@dataclass
class _Subject:
    """One method's caches and its decode state: ``y`` [1, 1] the next input token; the
    per-step host and eval seconds and the per-flush seconds of every round."""

    method: str
    caches: list[Any]
    y: mx.array
    host: list[float] = field(default_factory=list)
    eval: list[float] = field(default_factory=list)
    flush: list[float] = field(default_factory=list)


# -- models and methods ----------------------------------------------------------------------


def _shape_info(module: nn.Module) -> dict[str, Any]:
    args = module.args
    return {
        "layers": len(module.layers),
        "hidden": args.hidden_size,
        "heads": args.num_attention_heads,
        "kv_heads": args.num_key_value_heads,
        "vocab": args.vocab_size,
    }


def load_model(name: str, small: bool = False) -> Model:
    """``smollm2`` (the embedded model; ``ModelNotFoundError`` when not installed) or
    ``real-shape`` (a random llama, seed 0; ``small``: 2 layers, hidden 64)."""
    if name == SMOLLM2:
        from velox_mlx_lm.embedded import load

        module, _ = load("smollm2-135m")
        info = {"description": "SmolLM2-135M-Instruct (float32, dequantized), random tokens"}
    elif name == REAL_SHAPE:
        shape = SMOKE_SHAPE_ARGS if small else REAL_SHAPE_ARGS
        module = random_llama(
            shape["layers"],
            shape["hidden"],
            shape["heads"],
            shape["kv_heads"],
            intermediate=shape["intermediate"],
            vocab=shape["vocab"],
        )
        info = {"description": "random llama (seed 0, float32), random tokens"}
    else:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    info.update(_shape_info(module))
    return Model(name, module, int(module.args.vocab_size), info)


def methods() -> list[str]:
    """The rows: ``full``, ``rotating``, then every cache-only Velox method in registry order."""
    return [FULL, ROTATING] + [v.name for v in policy_variants()]


def skipped_methods() -> dict[str, str]:
    """Registered methods left out, with why (their prompt end is a model pass)."""
    measured = set(methods())
    return {
        m: "its prompt end is a model pass (not a cache-only method)"
        for m in registered_methods()
        if m not in measured
    }


# -- one method's steps ----------------------------------------------------------------------


def _flush(subject: _Subject) -> float:
    """Evaluate every cache's state arrays; return the seconds it took."""
    start = time.perf_counter()
    mx.eval([c.state for c in subject.caches])
    return time.perf_counter() - start


def _step(model: nn.Module, subject: _Subject) -> tuple[float, float]:
    """One greedy decode step: (host seconds, eval seconds); ``subject.y`` advanced."""
    t0 = time.perf_counter()
    logits = model(subject.y, cache=subject.caches)
    y = mx.argmax(logits[:, -1:], axis=-1)
    t1 = time.perf_counter()
    mx.eval(y)
    t2 = time.perf_counter()
    subject.y = y
    return t1 - t0, t2 - t1


def _round(model: nn.Module, subject: _Subject, settings: Settings) -> None:
    """``warmup`` untimed steps, then ``steps`` timed ones, the state flushed every
    ``flush_every`` steps and at the end, outside the timed region."""
    for _ in range(settings.warmup):
        _step(model, subject)
    _flush(subject)
    for i in range(settings.steps):
        host, ev = _step(model, subject)
        subject.host.append(host)
        subject.eval.append(ev)
        if (i + 1) % settings.flush_every == 0:
            subject.flush.append(_flush(subject))
    subject.flush.append(_flush(subject))


def _prepared(model: Model, method: str, settings: Settings, tokens: mx.array) -> _Subject:
    """``method``'s caches with ``tokens`` [1, context] prefilled (chunks of ``chunk``)."""
    caches = make_caches(model.module, method, settings.budget)
    y = prefill(model.module, caches, tokens, step=settings.chunk)
    return _Subject(method, caches, y)


def fast_path_fraction(caches: Sequence[Any]) -> float | None:
    """Fraction of Velox layers whose next decode step takes the decode fast path
    (``Layer.fast_path``), ``None`` for caches without Velox layers."""
    layers = [c.layer for c in caches if isinstance(c, PolicyKVCache)]
    if not layers:
        return None
    fast = sum(layer.fast_path for layer in layers)
    return fast / len(layers)


# -- rows -----------------------------------------------------------------------------------


def _ratio(row: dict[str, Any], reference: dict[str, Any] | None, key: str) -> float | None:
    """``row[key] / reference[key]`` (``None`` without a reference)."""
    if reference is None or reference[key] <= 0:
        return None
    return float(row[key] / reference[key])


def _row(subject: _Subject) -> dict[str, Any]:
    totals = [h + e for h, e in zip(subject.host, subject.eval, strict=True)]
    return {
        "method": subject.method,
        "baseline": subject.method in (FULL, ROTATING),
        "host_ms": statistics.median(subject.host) * 1e3,
        "eval_ms": statistics.median(subject.eval) * 1e3,
        "total_ms": statistics.median(totals) * 1e3,
        "flush_ms": statistics.median(subject.flush) * 1e3 if subject.flush else None,
        "flush_ms_per_step": sum(subject.flush) / len(subject.host) * 1e3,
        "timed_steps": len(subject.host),
        "tokens_held": max(int(c.size()) for c in subject.caches),
        "fast_path_fraction": fast_path_fraction(subject.caches),
    }


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with host/eval/total over ``full``'s and total over ``rotating``'s (``None``
    when that row is missing)."""
    by = {r["method"]: r for r in rows}
    full, rotating = by.get(FULL), by.get(ROTATING)
    out = []
    for r in rows:
        ratios = {f"{k}_vs_full": _ratio(r, full, f"{k}_ms") for k in ("host", "eval", "total")}
        ratios["total_vs_rotating"] = _ratio(r, rotating, "total_ms")
        out.append({**r, **ratios})
    return out


# -- the measurement ---------------------------------------------------------------------------


def _progress(total: int, show: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, desc="decode_host", unit="run", disable=not show, leave=False)


def _rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


def measure(
    model: Model,
    settings: Settings,
    methods_: Sequence[str] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Every method of ``methods_`` (default :func:`methods`) on ``model``, rounds interleaved;
    one run's results: settings, model info, skipped methods and one row per method."""
    names = list(methods_ or methods())
    tokens = mx.random.randint(0, model.vocab, (1, settings.context), key=mx.random.key(0))
    subjects: dict[str, _Subject] = {}
    with _progress(len(names) * (1 + settings.rounds), progress) as bar:
        for name in names:
            bar.set_postfix_str(f"prefill {name}")
            subjects[name] = _prepared(model, name, settings, tokens)
            bar.update()
        for r in range(settings.rounds):
            for name in _rotated(names, r):
                bar.set_postfix_str(f"round {r + 1} {name}")
                _round(model.module, subjects[name], settings)
                bar.update()
    rows = _with_ratios([_row(subjects[n]) for n in names])
    return {
        "model": model.name,
        "model_info": model.info,
        "settings": asdict(settings),
        "skipped": {m: why for m, why in skipped_methods().items() if m not in names},
        "rows": rows,
    }


# -- output ---------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(run: dict[str, Any]) -> str:
    """One run as a plain-text table (ms medians; ratios to ``full`` and ``rotating``)."""
    s = run["settings"]
    head = (
        f"{run['model']}: {run['model_info']['description']}, {run['model_info']['layers']} "
        f"layers; context {s['context']}, budget {s['budget']}, "
        f"{s['steps']} steps x {s['rounds']} rounds"
    )
    cols = f"{'method':<20}{'host ms':>9}{'eval ms':>9}{'total ms':>10}"
    cols += f"{'host/full':>11}{'eval/full':>11}{'tot/full':>10}{'tot/rot':>9}{'fast':>6}"
    cols += f"{'flush ms/step':>15}"
    lines = [head, cols, "-" * len(cols)]
    for r in run["rows"]:
        fast = r["fast_path_fraction"]
        lines.append(
            f"{r['method']:<20}{r['host_ms']:>9.3f}{r['eval_ms']:>9.3f}{r['total_ms']:>10.3f}"
            f"{_fmt(r['host_vs_full']):>11}{_fmt(r['eval_vs_full']):>11}"
            f"{_fmt(r['total_vs_full']):>10}{_fmt(r['total_vs_rotating']):>9}"
            f"{'-' if fast is None else f'{fast:.0%}':>6}{r['flush_ms_per_step']:>15.3f}"
        )
    lines += [f"skipped {m}: {why}" for m, why in run["skipped"].items()]
    return "\n".join(lines)


def payload(runs: list[dict[str, Any]], notes: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON document of ``runs``: machine, BLAS, smoke flag, notes and the runs."""
    from velox_bench.results import blas_report

    return {
        "suite": SUITE,
        "machine": machine_info(),
        "blas": blas_report(),
        "smoke": smoke(),
        "notes": list(notes),
        "runs": runs,
    }


def _settings(args: argparse.Namespace) -> Settings:
    """The command line's sizes over the defaults (smoke sizes under ``VELOX_BENCH_SMOKE``)."""
    base = SMOKE_SETTINGS if smoke() else Settings()
    given = {
        k: getattr(args, k)
        for k in ("context", "budget", "steps", "rounds", "warmup")
        if getattr(args, k) is not None
    }
    return Settings(**{**asdict(base), **given})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=SMOLLM2)
    for name in ("context", "budget", "steps", "rounds", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--methods", default=None, help="comma-separated (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure one model from the command line, print the table, write the JSON; return it."""
    args = _parser().parse_args(argv)
    settings = _settings(args)
    chosen = args.methods.split(",") if args.methods else None
    model = load_model(args.model, small=smoke())
    run = measure(model, settings, chosen, progress=not args.no_progress)
    print(table(run))
    out = payload([run])
    if args.out is None:
        path = write_json(SUITE, out)
    else:
        path = args.out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
