"""Tables and figures of the RULER-style grid (``benchmarks/results/ruler.json``).

``python -m velox_bench.quality.ruler_report --out .`` reads the rows ``nox -s bench -- ruler``
wrote and writes, per model, a table (one row per method and budget, one column per task with
the mean score at each context length) and a figure (mean score over tasks against length)
into docs/benchmarks.md between the ``ruler`` markers. Nothing here runs a model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from velox_bench.quality.report import replace_between
from velox_bench.quality.ruler import KINDS
from velox_bench.results import save_figure

__all__ = ["markdown", "means", "plot", "write"]

Run = tuple[str, int | None]  # (method, budget); budget None for the full cache
Means = dict[Run, dict[tuple[str, int], float]]  # run -> (task, length) -> mean score


def means(rows: Sequence[dict[str, Any]], model: str) -> tuple[Means, dict[tuple[str, int], int]]:
    """Mean score per run and (task, length) for ``model``, and the samples behind each cell
    (the full cache's count; every run of a cell answers the same samples when complete)."""
    scores: dict[Run, dict[tuple[str, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["model"] == model:
            scores[(r["method"], r["budget"])][(r["task"], r["length"])].append(r["score"])
    found = {run: {cell: mean(v) for cell, v in cells.items()} for run, cells in scores.items()}
    counts = {cell: len(v) for cells in scores.values() for cell, v in cells.items()}
    return found, counts


def _order(run: Run) -> tuple[int, int, str]:
    method, budget = run
    return (0 if budget is None else 1, budget or 0, method)


def _label(run: Run) -> str:
    method, budget = run
    return method if budget is None else f"{method} ({budget})"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def table(found: Means, lengths: Sequence[int]) -> str:
    """Markdown: a row per run; per task the mean score at each length ("2k / 4k / 8k"), then
    the mean over the tasks at each length (a run's lengths can differ: ``-`` where not run)."""
    kinds = [k for k in KINDS if any(k == task for cells in found.values() for task, _ in cells)]
    spans = " / ".join(_k(n) for n in lengths)
    lines = [
        "| method (budget) | "
        + " | ".join(f"{k} ({spans})" for k in kinds)
        + f" | mean ({spans}) |",
        "| --- | " + " | ".join("---:" for _ in kinds) + " | ---: |",
    ]
    for run in sorted(found, key=_order):
        cells = found[run]
        parts = [
            " / ".join(f"{cells[(k, n)]:.2f}" if (k, n) in cells else "-" for n in lengths)
            for k in kinds
        ]
        per_length = [_mean_at(cells, n) for n in lengths]
        lines.append(f"| {_label(run)} | " + " | ".join(parts) + f" | {' / '.join(per_length)} |")
    return "\n".join(lines)


def _mean_at(cells: dict[tuple[str, int], float], length: int) -> str:
    """The mean over the tasks a run has at ``length``, formatted (``-``: none)."""
    scores = [v for (_, n), v in cells.items() if n == length]
    return f"{mean(scores):.2f}" if scores else "-"


def plot(found: Means, lengths: Sequence[int], model: str, path: Path) -> None:
    """Mean score over the tasks against context length, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in sorted(found, key=_order):
        cells = found[run]
        xs = [n for n in lengths if any((k, n) in cells for k in KINDS)]
        ys = [mean(v for (k, m), v in cells.items() if m == n) for n in xs]
        style: dict[str, Any] = {"marker": "o"}
        if run[1] is None:
            style = {"color": "black", "linestyle": "--", "marker": "s"}
        elif run[1] == min(b for _, b in found if b is not None):
            style["linestyle"] = ":"
        ax.plot(xs, ys, label=_label(run), **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [_k(n) for n in lengths])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("mean score over the four tasks")
    ax.set_title(f"RULER-style tasks: {model}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, [path], dpi=120)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The docs section: how it was made, then a table and a figure per model."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    parts = []
    for model in models:
        found, counts = means(rows, model)
        samples = sorted(set(counts.values()))
        minutes = sum(r.get("seconds", 0.0) for r in rows if r["model"] == model) / 60
        parts.append(
            f"#### {model}\n\n"
            f"{'/'.join(map(str, samples))} sample(s) per task and length; "
            f"{sum(r['model'] == model for r in rows)} answers, "
            f"{minutes:.0f} minutes of wall time.\n\n"
            f"{table(found, lengths)}\n\n"
            f"![RULER-style tasks, {model}](figures/ruler_{model}.png)"
        )
    return (
        "Produced by `VELOX_RULER=full nox -s bench -- ruler` (the settings used are in "
        "`benchmarks/results/ruler.json`, one row per answer) and "
        "`python -m velox_bench.quality.ruler_report --out .`. Each cell is the mean "
        "`string_match_all` score over the samples; `-` is a cell not run.\n\n" + "\n\n".join(parts)
    )


def write(rows: Sequence[dict[str, Any]], root: Path) -> list[Path]:
    """Figures (also under docs/figures/) and the docs section between the ruler markers."""
    written = []
    lengths = sorted({r["length"] for r in rows})
    for model in dict.fromkeys(r["model"] for r in rows):
        figure = root / "benchmarks" / "figures" / f"ruler_{model}.png"
        figure.parent.mkdir(parents=True, exist_ok=True)
        plot(means(rows, model)[0], lengths, model, figure)
        docs_figure = root / "docs" / "figures" / figure.name
        docs_figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(figure, docs_figure)
        written += [figure, docs_figure]
    doc = root / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    doc.write_text(
        replace_between(text, "<!-- ruler:start -->", "<!-- ruler:end -->", markdown(rows))
    )
    return [*written, doc]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality.ruler_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/ruler.json"))
    parser.add_argument("--out", type=Path, help="repository root to write into (default: print)")
    args = parser.parse_args(argv)
    rows = json.loads(args.json.read_text())["rows"]
    if args.out is None:
        print(markdown(rows))
        return 0
    for path in write(rows, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
