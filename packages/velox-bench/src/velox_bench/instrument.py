"""``python -m velox_bench.instrument``: the Qwen2.5-Coder-1.5B quality grid, resumable.

Runs the cells of :func:`velox_bench.quality.instrument.plan` in order (the mandatory ones
first), skipping those already in the results file, and appends one JSON line per finished
cell, so it can be stopped at any time and run again. Prints the machine-hours the remaining
cells should take before it starts, a progress bar over the tokens it feeds, and a summary table
of every row in the file at the end.

    python -m velox_bench.instrument                 # every cell not yet measured
    python -m velox_bench.instrument --only retrieval/8192 --max-cells 2
    python -m velox_bench.instrument --quick         # a tiny random qwen2 model, 4 small cells
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from velox_blas import preload_openblas

preload_openblas()

from velox_bench.quality import instrument as grid  # noqa: E402
from velox_bench.quality.run import environment, repo_root  # noqa: E402

MODEL = "qwen2.5-coder-1.5b"
RESULTS = Path("benchmarks/results/instrument_qwen2.5-coder-1.5b.jsonl")


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
    lines = [f"{'cell':<34} {'10%':>6} {'50%':>6} {'90%':>6} {'ppl':>8} {'min':>6}"]
    for r in rows:
        if r["task"] == "retrieval":
            acc = [r["depths"][str(d)]["accuracy"] for d in grid.DEPTHS]
            cols = " ".join(f"{a:6.2f}" for a in acc) + f" {'':>8}"
        else:
            cols = f"{'':>6} {'':>6} {'':>6} {r['perplexity']:8.3f}"
        lines.append(f"{r['key']:<34} {cols} {r['seconds'] / 60:6.1f}")
    return "\n".join(lines)


def _todo(args: argparse.Namespace, out: Path, model_name: str) -> list[grid.Cell]:
    """The cells still to run, in the plan's order, as ``--only`` and ``--max-cells`` cut."""
    done = grid.done_keys(out, model_name)
    cells = [
        c
        for c in grid.plan(quick=args.quick)
        if c.key() not in done and c.key().startswith(args.only)
    ]
    cells = cells[: args.max_cells] if args.max_cells else cells
    hours = grid.estimate_hours(cells, MODEL, args.n_per_depth)
    print(
        f"{len(done)} cells already in {out}; {len(cells)} to run, about {hours:.1f} "
        "machine-hours on the 2-core machine"
    )
    for cell in cells:
        print(f"  {cell.key()}")
    return cells


def _run(args: argparse.Namespace, cells: list[grid.Cell], out: Path, where: Path) -> None:
    """Measure ``cells`` in turn, appending each row to ``out`` as it comes."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    model, tokenizer, model_name = _load(args.quick, where)
    env = environment() | {"model": model_name}
    n_per_depth = 2 if args.quick else args.n_per_depth
    for cell in cells:
        with tqdm(desc=cell.key(), unit="tok", total=cell.length) as bar:
            row = grid.run_cell(
                model, tokenizer, cell, n_per_depth=n_per_depth, batch=args.batch,
                step=bar.update,
            )  # fmt: skip
        row = {"model": model_name, **row, "environment": env}
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(summary([row]).splitlines()[1], flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.n_per_depth < 1 or args.batch < 1 or args.max_cells < 0:
        raise SystemExit("--n-per-depth and --batch must be >= 1, --max-cells >= 0")
    model_name = "tiny-qwen2" if args.quick else MODEL
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or (Path(tmp) / "quick.jsonl" if args.quick else repo_root() / RESULTS)
        cells = _todo(args, out, model_name)
        if cells and not args.plan:
            _run(args, cells, out, Path(tmp))
        print(summary([r for r in grid.read_rows(out) if r.get("model") == model_name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
