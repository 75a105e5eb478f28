"""``python -m velox_bench.instrument``: the Qwen2.5-Coder-1.5B quality grid, resumable.

Runs the cells of :func:`velox_bench.quality.instrument.plan` in order (the mandatory ones
first), skipping those already in the results file, and appends one JSON line per finished
cell, so it can be stopped at any time and run again. Prints the machine-hours the remaining
cells should take before it starts, a progress bar over the tokens it feeds, and a summary table
of every row in the file at the end.

    python -m velox_bench.instrument                 # every cell not yet measured
    python -m velox_bench.instrument --only retrieval/8192 --max-cells 2
    python -m velox_bench.instrument --quick         # a tiny random qwen2 model, 5 small cells
    python -m velox_bench.instrument --markdown      # the measured rows as tables
    python -m velox_bench.instrument --figure benchmarks/figures/instrument_retrieval.png
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import velox_blas

velox_blas.preload_openblas()  # before anything imports mlx

from velox_bench.quality import instrument as grid  # noqa: E402
from velox_bench.quality.checkpoint import Checkpoint  # noqa: E402
from velox_bench.quality.ruler import KINDS as RULER_KINDS  # noqa: E402
from velox_bench.quality.run import environment, repo_root  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
RESULTS = Path("benchmarks/results/instrument_qwen2.5-coder-1.5b.jsonl")
Saves = Callable[[str], Checkpoint]  # a read's checkpoint by its key


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m velox_bench.instrument",
        description="Quality of every method on Qwen2.5-Coder-1.5B (resumable; see "
        "docs/benchmarks.md).",
    )
    p.add_argument("--quick", action="store_true", help="a tiny random qwen2 model, small cells")
    p.add_argument("--only", default="", help="run only cells whose key starts with this")
    p.add_argument("--max-cells", type=int, default=0, help="stop after N cells (0: all)")
    p.add_argument("--n-per-depth", type=int, default=grid.N_PER_DEPTH, help="facts per depth")
    p.add_argument("--batch", type=int, default=10, help="questions answered as one batch")
    p.add_argument("--out", type=Path, default=None, help=f"results file (default {RESULTS})")
    p.add_argument("--plan", action="store_true", help="print the cells and the estimate only")
    p.add_argument(
        "--markdown", action="store_true", help="print the measured rows as Markdown tables only"
    )
    p.add_argument(
        "--figure",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw retrieval accuracy by depth (one panel per length) to PNG and exit",
    )
    return p


def _load(quick: bool, where: Path) -> tuple[Any, Any, str]:
    from velox_mlx_lm.embedded import load
    from velox_mlx_lm.embedded.qwen2 import load_qwen2_gguf
    from velox_mlx_lm.embedded.tiny_qwen2 import write_tiny_qwen2_gguf

    if quick:
        model, tokenizer = load_qwen2_gguf(write_tiny_qwen2_gguf(where / "tiny-qwen2.gguf"))
        return model, tokenizer, "tiny-qwen2"
    model, tokenizer = load(MODEL)
    return model, tokenizer, MODEL


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """One line per cell: retrieval accuracy by depth, or perplexity."""
    lines = [f"{'cell':<34} {'10%':>6} {'50%':>6} {'90%':>6} {'ppl|ruler':>9} {'min':>6}"]
    for r in rows:
        if r["task"] == "retrieval":
            acc = [r["depths"][str(d)]["accuracy"] for d in grid.DEPTHS]
            cols = " ".join(f"{a:6.2f}" for a in acc) + f" {'':>9}"
        elif r["task"] == "ruler":
            cols = f"{'':>6} {'':>6} {'':>6} {r['mean']:9.3f}"
        else:
            cols = f"{'':>6} {'':>6} {'':>6} {r['perplexity']:9.3f}"
        lines.append(f"{r['key']:<34} {cols} {r['seconds'] / 60:6.1f}")
    return "\n".join(lines)


def _todo(
    args: argparse.Namespace, out: Path, model_name: str, kinds: grid.KindLog, saves: Saves
) -> list[grid.Cell]:
    """The cells still to run, in the plan's order, as ``--only`` and ``--max-cells`` cut,
    each with what earlier sittings left of it."""
    done = grid.done_keys(out, model_name)
    cells = [
        c
        for c in grid.plan(quick=args.quick)
        if c.key() not in done and c.key().startswith(args.only)
    ]
    cells = cells[: args.max_cells] if args.max_cells else cells
    hours = grid.estimate_hours(cells, MODEL, args.n_per_depth, kinds, saves)
    print(
        f"{len(done)} cells already in {out}; {len(cells)} to run, about {hours:.1f} "
        "machine-hours on the 2-core machine"
    )
    for cell in cells:
        print(f"  {cell.key()}{_left(cell, kinds, saves)}")
    return cells


def _left(cell: grid.Cell, kinds: grid.KindLog, saves: Saves) -> str:
    """`` (done: ...)`` for a RULER-style cell's finished kinds, `` (read: N tokens kept)``
    for a retrieval cell's checkpoint, or nothing."""
    if cell.task == "ruler":
        finished = sorted(kinds.saved(cell.key()))
        return f" (done: {', '.join(finished)})" if finished else ""
    saved = saves(cell.key()).saved()
    if saved is None:
        return ""
    what = "done" if saved.done else f"{saved.fed} tokens kept"
    return f" (read: {what}, {saved.seconds / 60:.0f} min so far)"


def _run(
    args: argparse.Namespace,
    cells: list[grid.Cell],
    out: Path,
    where: Path,
    kinds: grid.KindLog,
    saves: Saves,
) -> None:
    """Measure ``cells`` in turn, appending each row to ``out`` as it comes (a cell's
    checkpoint goes once its row is written)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    model, tokenizer, model_name = _load(args.quick, where)
    env = environment() | {"model": model_name}
    n_per_depth = 2 if args.quick else args.n_per_depth
    for cell in cells:
        total = cell.length * (len(RULER_KINDS) if cell.task == "ruler" else 1)
        with tqdm(desc=cell.key(), unit="tok", total=total) as bar:
            row = grid.run_cell(
                model, tokenizer, cell, n_per_depth=n_per_depth, batch=args.batch,
                step=bar.update, kinds=kinds, saves=saves,
            )  # fmt: skip
        row = {"model": model_name, **row, "environment": env}
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        saves(cell.key()).clear()
        print(summary([row]).splitlines()[1], flush=True)


def partial_path(out: Path) -> Path:
    """Where the finished kinds of an unfinished RULER-style cell wait (beside ``out``)."""
    return out.with_name(out.stem + ".partial.jsonl")


def _share(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """Accuracy by depth as a share of the full cache's (``-`` where the full cache has 0)."""
    if ref is None:
        return ""
    acc = [row["depths"][str(d)]["accuracy"] for d in grid.DEPTHS]
    base = [ref["depths"][str(d)]["accuracy"] for d in grid.DEPTHS]
    return " / ".join(f"{a / b:.2f}" if b else "-" for a, b in zip(acc, base, strict=True))


def _label(row: dict[str, Any]) -> str:
    """The row's method, with its quantized rows (``4-bit ch``) or demoted tier (``+ 2-bit
    tier of 4524``) when it has them."""
    label = str(row["method"])
    if row.get("kv_bits"):
        label += f" {row['kv_bits']}-bit ch"
    if row.get("demote_bits"):
        label += f" + {row['demote_bits']}-bit tier of {row['demote_budget']}"
    return label


def _retrieval_line(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    acc = " | ".join(f"{row['depths'][str(d)]['accuracy']:.2f}" for d in grid.DEPTHS)
    return (
        f"| {row['length']} | {_label(row)} | {row['budget'] or '-'} "
        f"| {row['kept_tokens'] or '-'} | {acc} | {_share(row, ref)} "
        f"| {row['seconds'] / 60:.0f} |"
    )


def _perplexity_line(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    ratio = f"{row['perplexity'] / ref['perplexity']:.3f}" if ref else ""
    return (
        f"| {row['task'][4:]} | {row['length']} | {_label(row)} | {row['budget'] or '-'} "
        f"| {row['perplexity']:.3f} | {ratio} | {row['seconds'] / 60:.0f} |"
    )


def _ruler_line(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    scores = " | ".join(f"{row['tasks'][k]['score']:.2f}" for k in RULER_KINDS)
    share = f"{row['mean'] / ref['mean']:.2f}" if ref and ref["mean"] else ""
    return (
        f"| {row['length']} | {_label(row)} | {row['budget'] or '-'} | {scores} "
        f"| {row['mean']:.2f} | {share} | {row['seconds'] / 60:.0f} |"
    )


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The measured rows as Markdown tables: retrieval accuracy by depth (with the share of
    the full cache's accuracy at the same length), the RULER-style tasks (with the mean's
    share of the full cache's), then perplexity (with the ratio to the full cache's on the
    same text)."""
    full = {(r["task"], r["length"]): r for r in rows if r["method"] == "full"}
    out = [
        "| length | method | budget | kept | 10% | 50% | 90% | vs full (10 / 50 / 90%) | min |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    found = [r for r in rows if r["task"] == "retrieval"]
    out += [_retrieval_line(r, full.get((r["task"], r["length"]))) for r in found]
    if found:
        out += ["", f"({found[0]['depths'][str(grid.DEPTHS[0])]['n']} questions per depth)"]
    ruler = [r for r in rows if r["task"] == "ruler"]
    if ruler:
        out += [
            "",
            f"| length | method | budget | {' | '.join(RULER_KINDS)} | mean | vs full | min |",
        ]
        out += ["| ---: | --- | ---: |" + " ---: |" * len(RULER_KINDS) + " ---: | ---: | ---: |"]
        out += [_ruler_line(r, full.get((r["task"], r["length"]))) for r in ruler]
    out += ["", "| text | length | method | budget | perplexity | vs full | min |"]
    out += ["| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    out += [
        _perplexity_line(r, full.get((r["task"], r["length"])))
        for r in rows
        if r["task"].startswith("ppl")
    ]
    return "\n".join(out)


def _panel(ax: Any, found: list[dict[str, Any]], length: int) -> None:
    """One length's bars: a group per cell (the full cache first), a bar per depth."""
    cells = sorted(found, key=lambda r: (r["method"] != "full", r["budget"] or 0, r["method"]))
    width = 0.8 / len(grid.DEPTHS)
    for j, depth in enumerate(grid.DEPTHS):
        acc = [r["depths"][str(depth)]["accuracy"] for r in cells]
        xs = [i + (j - (len(grid.DEPTHS) - 1) / 2) * width for i in range(len(cells))]
        ax.bar(xs, acc, width, label=f"{depth:.0%} depth")
    labels = [f"{_label(r)}, {r['budget'] or 'all'}" for r in cells]
    ax.set_xticks(range(len(cells)), labels, fontsize=8, rotation=35, ha="right")
    ax.set_xlim(-0.6, max(len(cells), 4) - 0.4)  # bars keep their width in a thin panel
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("retrieval accuracy")
    ax.set_title(f"{MODEL}, {length} tokens")
    ax.legend(fontsize=8)


def figure(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Retrieval accuracy by depth, one panel per measured length, one group of bars per
    method (its budget in the label), the full cache first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [r for r in rows if r["task"] == "retrieval"]
    lengths = sorted({r["length"] for r in found})
    if not lengths:
        raise ValueError("no retrieval rows to draw")
    counts = [max(4, sum(r["length"] == n for r in found)) for n in lengths]
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(0.75 * sum(counts) + 1.5, 5.2), squeeze=False,
        gridspec_kw={"width_ratios": counts},
    )  # fmt: skip
    for ax, length in zip(axes[0], lengths, strict=True):
        _panel(ax, [r for r in found if r["length"] == length], length)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.n_per_depth < 1 or args.batch < 1 or args.max_cells < 0:
        raise SystemExit("--n-per-depth and --batch must be >= 1, --max-cells >= 0")
    model_name = "tiny-qwen2" if args.quick else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or (Path(tmp) / "quick.jsonl" if args.quick else repo_root() / RESULTS)
        if args.markdown or args.figure is not None:
            _report(args, [r for r in grid.read_rows(out) if r.get("model") == model_name])
            return 0
        kinds = grid.KindLog(partial_path(out), model_name)  # finished RULER-style prompts
        saves = functools.partial(Checkpoint.beside, out, model_name)  # reads part way
        cells = _todo(args, out, model_name, kinds, saves)
        if cells and not args.plan:
            _run(args, cells, out, Path(tmp), kinds, saves)
        print(summary([r for r in grid.read_rows(out) if r.get("model") == model_name]))
    return 0


def _report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """``--markdown`` prints the tables, ``--figure`` draws the figure."""
    if args.markdown:
        print(markdown(rows))
    if args.figure is not None:
        print(f"wrote {figure(rows, args.figure)}")


if __name__ == "__main__":
    raise SystemExit(main())
