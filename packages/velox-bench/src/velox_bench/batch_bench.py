"""Batched decode: Velox's ``BatchVeloxKVCache`` next to one sequence and mlx-lm's own batch.

What is measured (``benchmarks/test_batch.py`` drives it; issue 13, "Performance"):

- **decode, batch of 4 vs one sequence**, same method: aggregate tokens/s
  (``B * steps / seconds``) of 4 rows against 1;
- **TOVA vs the full cache, batch of 4**: TOVA's ``BatchVeloxKVCache`` against mlx-lm's own
  ``BatchKVCache`` (method ``full``) at several contexts per row, with the peak memory of each;
- **per-row eviction overhead**: at a context equal to the budget (512 rows, nothing saved) the
  batched TOVA step against the batched full-cache step.

How decode is driven: the model is called on ``[B, 1]`` tokens with merged caches, and only
the next tokens are evaluated (``mx.eval(y)``), as ``BatchGenerator`` and ``generate_step`` do
in decode; the caches' ``state`` is not evaluated per step (mlx-lm does that only after prefill
chunks). The batch of 4 is made the way ``BatchGenerator`` makes one from finished prompts:
``type(cache).merge([...])`` per layer over single-sequence caches (Velox: a
``BatchVeloxKVCache``; mlx-lm's ``KVCache``: a ``BatchKVCache``). The four rows hold the same
prompt: a decode step's cost does not depend on the token values, and one prefill per context
instead of four keeps the run short.

Caches:

- TOVA is prefilled by the model once per model, through the longest context, in chunks that
  end at every measured context; a deep copy is kept at each (``snapshots``).
- The full cache's keys and values are random normal arrays of the model's KV shape and dtype
  (``random_full_cache``): a full-cache decode step attends over every stored key whatever its
  value, so its cost does not depend on them, and prefilling 8k tokens through the embedded
  model with a full cache takes minutes on a CPU.

Every timed round starts from a fresh copy of those caches (deep copy for one sequence, a merge
for the batch), takes one untimed warm-up step (mlx-lm's ``BatchKVCache`` grows its buffer, the
copies get their own arrays), then ``steps`` timed steps. Variants are interleaved: every
variant once per round, the order rotated from round to round. Peak memory: MLX's peak during
the round (copy, warm-up and timed steps) above the memory active before it, so the caches kept
for later rounds do not count.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from velox_bench.models import make_caches
from velox_bench.results import save_figure

__all__ = [
    "BATCH",
    "FULL",
    "TOVA",
    "Variant",
    "batch_summary",
    "batch_table",
    "chunk_bounds",
    "measure_context",
    "plot_batch",
    "random_full_cache",
    "rows_for",
    "snapshots",
    "variants",
]

TOVA = "tova"
FULL = "full"
BATCH = 4
METHODS = (TOVA, FULL)


@dataclass(frozen=True)
class Variant:
    """One timed configuration: a method and a batch size."""

    method: str
    batch: int

    @property
    def name(self) -> str:
        return f"{self.method} B={self.batch}"


def variants(batch: int = BATCH) -> list[Variant]:
    return [Variant(m, b) for m in METHODS for b in (1, batch)]


def _eval_caches(caches: Sequence[Any], *arrays: Any) -> None:
    mx.eval(*arrays, [c.state for c in caches])


def chunk_bounds(contexts: Sequence[int], chunk: int) -> list[int]:
    """Where the prefill chunks end: every ``chunk`` tokens and at every context."""
    bounds: list[int] = []
    start = 0
    for end in sorted(set(contexts)):
        while start < end:
            start = min(start + chunk, end)
            bounds.append(start)
    return bounds


def snapshots(
    model: nn.Module,
    tokens: mx.array,
    contexts: Sequence[int],
    budget: int,
    chunk: int,
    on_chunk: Callable[[int], None] | None = None,
) -> dict[int, tuple[list[Any], mx.array]]:
    """Prefill single-sequence TOVA caches with ``tokens [1, max(contexts)]`` in chunks of at
    most ``chunk`` that end at every context; ``{context: (deep copy of the caches, next
    greedy token [1, 1])}``. ``on_chunk(n)`` is called with each chunk's length."""
    caches = make_caches(model, TOVA, budget)
    ends = sorted(set(contexts))
    bounds = chunk_bounds(contexts, chunk)
    out: dict[int, tuple[list[Any], mx.array]] = {}
    prev = 0
    for end in bounds:
        logits = model(tokens[:, prev:end], cache=caches)
        fed, prev = end - prev, end
        if end in ends:
            done = copy.deepcopy(caches)
            for c in done:  # ends the prompt like mlx-lm's generate does (a no-op for TOVA)
                if hasattr(c, "finish_prefill"):
                    c.finish_prefill()
            y = mx.argmax(logits[:, -1:, :], axis=-1)
            _eval_caches(done, y)
            out[end] = (done, y)
        else:
            _eval_caches(caches)
        if on_chunk is not None:
            on_chunk(fed)
    return out


def _kv_shape(model: nn.Module) -> tuple[int, int, mx.Dtype]:
    """(KV heads, head dim, dtype) of the model's attention."""
    attn = model.layers[0].self_attn
    n_kv = attn.n_kv_heads
    head_dim = attn.k_proj.weight.shape[0] // n_kv
    return n_kv, head_dim, attn.k_proj.weight.dtype


def random_full_cache(model: nn.Module, context: int, seed: int = 0) -> list[KVCache]:
    """mlx-lm ``KVCache``s (one per layer) holding ``context`` random keys and values of the
    model's KV shape and dtype, offset ``context``: what a prefilled full cache costs a decode
    step, without the prefill."""
    n_kv, head_dim, dtype = _kv_shape(model)
    caches = []
    key = mx.random.key(seed)
    for _ in model.layers:
        key, k1, k2 = mx.random.split(key, 3)
        shape = (1, n_kv, context, head_dim)
        c = KVCache()
        c.update_and_fetch(
            mx.random.normal(shape, key=k1).astype(dtype),
            mx.random.normal(shape, key=k2).astype(dtype),
        )
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def _working(v: Variant, pristine: list[Any]) -> list[Any]:
    """A fresh cache list for ``v`` from the pristine single-sequence caches: a deep copy for
    one sequence, ``type(c).merge`` of ``v.batch`` copies per layer (what BatchGenerator does)."""
    if v.batch == 1:
        return copy.deepcopy(pristine)
    return [type(c).merge([c] * v.batch) for c in pristine]


def _step(model: nn.Module, caches: list[Any], y: mx.array) -> mx.array:
    """One greedy decode step; only the next tokens are evaluated (as mlx-lm's decode does)."""
    y = mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)
    mx.eval(y)
    return y


def measure_context(
    model: nn.Module,
    pristine: dict[str, tuple[list[Any], mx.array]],
    rounds: int,
    steps: int,
    batch: int = BATCH,
    on_round: Callable[[], None] | None = None,
    check: Callable[[Variant, list[Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Interleaved rounds over :func:`variants` at one context; ``pristine[method]`` holds the
    single-sequence caches and next token. Per variant: per-round seconds per step, peak bytes
    per round, KV bytes after the round. ``check(variant, caches)`` runs after each round."""
    vs = variants(batch)
    out: dict[str, dict[str, Any]] = {
        v.name: {"seconds": [], "peak_bytes": [], "kv_bytes": 0} for v in vs
    }
    for r in range(rounds):
        for v in vs[r % len(vs) :] + vs[: r % len(vs)]:
            caches0, y0 = pristine[v.method]
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            caches = _working(v, caches0)
            y = mx.concatenate([y0] * v.batch, axis=0) if v.batch > 1 else y0
            y = _step(model, caches, y)  # warm-up, untimed
            start = time.perf_counter()
            for _ in range(steps):
                y = _step(model, caches, y)
            elapsed = time.perf_counter() - start
            _eval_caches(caches)
            out[v.name]["seconds"].append(elapsed / steps)
            out[v.name]["peak_bytes"].append(mx.get_peak_memory() - base)
            out[v.name]["kv_bytes"] = int(sum(c.nbytes for c in caches))
            if check is not None:
                check(v, caches)
            del caches
            if on_round is not None:
                on_round()
    return out


def rows_for(
    model_name: str, context: int, measured: dict[str, dict[str, Any]], batch: int = BATCH
) -> list[dict[str, Any]]:
    """Result rows (one per variant) from :func:`measure_context`'s output."""
    rows = []
    for v in variants(batch):
        m = measured[v.name]
        seconds = statistics.median(m["seconds"])
        rows.append(
            dict(
                model=model_name,
                context=context,
                method=v.method,
                batch=v.batch,
                seconds_per_step=seconds,
                rounds=m["seconds"],
                tokens_per_s=v.batch / seconds,
                peak_bytes=int(statistics.median(m["peak_bytes"])),
                peak_bytes_rounds=m["peak_bytes"],
                kv_bytes=m["kv_bytes"],
            )
        )
    return rows


# -- summary ---------------------------------------------------------------------------------

TARGETS = {
    "batch_speedup_tova": (">=", 2.0),  # aggregate tokens/s, B=4 over B=1
    "tova_vs_full_b4_8192": (">=", 1.5),  # tokens/s, both batched
    "eviction_overhead_b4_512": ("<=", 1.15),  # step time, TOVA over full, both batched
}


def _check(name: str, value: float | None) -> dict[str, Any]:
    op, bound = TARGETS[name]
    met = None if value is None else (value <= bound if op == "<=" else value >= bound)
    return {"value": value, "target": f"{op} {bound}", "met": met}


def _paired(a: list[float], b: list[float]) -> float:
    """Median over rounds of the per-round ratio a/b (rounds of one context are interleaved)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


# A row of the batch suite by (model, context, method, batch).
_RowKey = tuple[str, int, str, int]


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Row ``a``'s step time over row ``b``'s: of the medians, and paired (see :func:`_paired`)."""
    return {
        "of_medians": a["seconds_per_step"] / b["seconds_per_step"],
        "paired": _paired(a["rounds"], b["rounds"]),
    }


def _context_ratios(
    by: dict[_RowKey, dict[str, Any]], model: str, *, ctx: int, batch: int
) -> dict[str, Any]:
    """One context of ``model`` in :func:`batch_summary`: B=``batch`` over B=1 aggregate
    tokens/s per method, TOVA against the full cache at both sizes, peak bytes at B=``batch``."""
    tb, t1 = by[(model, ctx, TOVA, batch)], by[(model, ctx, TOVA, 1)]
    fb, f1 = by[(model, ctx, FULL, batch)], by[(model, ctx, FULL, 1)]
    return {
        "batch_speedup": {  # aggregate tokens/s, B over 1
            m: {
                "of_medians": batch * one["seconds_per_step"] / b["seconds_per_step"],
                "paired": batch * _paired(one["rounds"], b["rounds"]),
            }
            for m, b, one in ((TOVA, tb, t1), (FULL, fb, f1))
        },
        "tova_vs_full_tokens_per_s": {
            f"B={b}": _ratio(f, t) for b, t, f in ((1, t1, f1), (batch, tb, fb))
        },
        "tova_over_full_step_time_b4": _ratio(tb, fb),
        "peak_bytes_b4": {TOVA: tb["peak_bytes"], FULL: fb["peak_bytes"]},
    }


def _peak_growth(
    by: dict[_RowKey, dict[str, Any]], model: str, *, contexts: list[int], budget: int, batch: int
) -> dict[str, Any]:
    """Per method at B=``batch``: peak and KV bytes at the longest context over those at the
    shortest context past ``budget`` (else the shortest); empty under two contexts."""
    growth: dict[str, Any] = {}
    if len(contexts) < 2:
        return growth
    lo, hi = [c for c in contexts if c > budget][:1] or contexts[:1], contexts[-1:]
    for m in METHODS:
        a, b = by[(model, lo[0], m, batch)], by[(model, hi[0], m, batch)]
        growth[m] = {
            "from": lo[0],
            "to": hi[0],
            "peak_ratio": b["peak_bytes"] / a["peak_bytes"] if a["peak_bytes"] else None,
            "kv_ratio": b["kv_bytes"] / a["kv_bytes"] if a["kv_bytes"] else None,
        }
    return growth


def _targets(
    per: dict[str, Any], *, contexts: list[int], budget: int, batch: int
) -> dict[str, dict[str, Any]]:
    """The issue's targets (:data:`TARGETS`) that the contexts ``per`` of one model measure."""
    targets = {}
    for ctx in contexts:
        if ctx > budget:
            v = per[str(ctx)]["batch_speedup"][TOVA]["of_medians"]
            targets[f"batch_speedup_tova_{ctx}"] = _check("batch_speedup_tova", v)
    if "8192" in per:
        v = per["8192"]["tova_vs_full_tokens_per_s"][f"B={batch}"]["of_medians"]
        targets["tova_vs_full_b4_8192"] = _check("tova_vs_full_b4_8192", v)
    if str(budget) in per:
        v = per[str(budget)]["tova_over_full_step_time_b4"]["of_medians"]
        targets[f"eviction_overhead_b4_{budget}"] = _check("eviction_overhead_b4_512", v)
    return targets


def batch_summary(rows: list[dict[str, Any]], budget: int, batch: int = BATCH) -> dict[str, Any]:
    """Ratios per model and context, memory growth with context, the issue's targets.

    Each ratio is given twice: of the medians, and as the median of per-round ratios."""
    by = {(r["model"], r["context"], r["method"], r["batch"]): r for r in rows}
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        contexts = sorted({r["context"] for r in rows if r["model"] == model})
        per = {str(ctx): _context_ratios(by, model, ctx=ctx, batch=batch) for ctx in contexts}
        out[model] = {
            "contexts": per,
            "peak_growth_b4": _peak_growth(
                by, model, contexts=contexts, budget=budget, batch=batch
            ),
            "targets": _targets(per, contexts=contexts, budget=budget, batch=batch),
        }
    return out


def batch_table(rows: list[dict[str, Any]], summary: dict[str, Any], batch: int = BATCH) -> str:
    """Plain-text table: per model, context and method, B=1 and B=batch side by side."""
    by = {(r["model"], r["context"], r["method"], r["batch"]): r for r in rows}
    head = (
        f"{'model':10}{'ctx':>6} {'method':7}{'ms/step B1':>11}{f'ms/step B{batch}':>11}"
        f"{'tok/s B1':>9}{f'tok/s B{batch}':>9}{'x batch':>8}{'tova/full':>10}"
        f"{f'peak MiB B{batch}':>13}{f'KV MiB B{batch}':>11}"
    )
    lines = [head]
    for model, ctx, method, b in by:
        if b != 1:
            continue
        one, many = by[(model, ctx, method, 1)], by[(model, ctx, method, batch)]
        s = summary[model]["contexts"][str(ctx)]
        vs_full = s["tova_vs_full_tokens_per_s"][f"B={batch}"]["of_medians"]
        lines.append(
            f"{model:10}{ctx:>6} {method:7}{one['seconds_per_step'] * 1e3:11.1f}"
            f"{many['seconds_per_step'] * 1e3:11.1f}{one['tokens_per_s']:9.2f}"
            f"{many['tokens_per_s']:9.2f}"
            f"{s['batch_speedup'][method]['of_medians']:8.2f}"
            f"{(f'{vs_full:.2f}' if method == TOVA else '-'):>10}"
            f"{many['peak_bytes'] / 2**20:13.0f}{many['kv_bytes'] / 2**20:11.1f}"
        )
    lines.append("")
    for model, s in summary.items():
        for name, t in s["targets"].items():
            met = {True: "met", False: "NOT met", None: "-"}[t["met"]]
            lines.append(f"{model:10} {name:28} {t['value']:.2f} (target {t['target']}): {met}")
        for m, g in s["peak_growth_b4"].items():
            lines.append(
                f"{model:10} peak B{batch} {m} {g['from']}->{g['to']}: x{g['peak_ratio']:.2f} "
                f"(KV bytes x{g['kv_ratio']:.2f})"
            )
    return "\n".join(lines)


def plot_batch(data: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    """Aggregate decode tokens/s and peak memory vs context per method and batch size, one
    column per model; written to every path in ``paths``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    panels = (
        ("tokens_per_s", "aggregate decode tokens/s", 1.0),
        ("peak_bytes", "peak memory of a decode round (MiB)", 1 / 2**20),
    )
    for col, model in enumerate(models):
        for row, (key, ylabel, factor) in enumerate(panels):
            ax = axes[row][col]
            series: dict[str, list[tuple[int, float]]] = {}
            for r in rows:
                if r["model"] == model:
                    name = f"{r['method']} B={r['batch']}"
                    series.setdefault(name, []).append((r["context"], r[key] * factor))
            for name, points in series.items():
                points.sort()
                style = "--" if name.startswith(FULL) else "-"
                marker = "s" if name.endswith("B=1") else "o"
                ax.plot([p[0] for p in points], [p[1] for p in points], style, marker=marker)
                ax.lines[-1].set_label(name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}", fontsize=10)
            ax.set_xlabel("context per row (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    settings = data["settings"]
    fig.suptitle(
        f"Batched decode: TOVA({settings.get('budget')}) BatchVeloxKVCache vs mlx-lm "
        f"BatchKVCache (full); {settings.get('steps_per_round')} steps x "
        f"{settings.get('rounds')} interleaved rounds, medians",
        fontsize=10,
    )
    fig.tight_layout()
    return save_figure(fig, paths)
