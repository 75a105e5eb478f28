"""Where KVzip's cut keeps rows: the kept share by depth, on the retrieval table's documents.

The retrieval table (``velox_bench.quality.run``) asks about pass keys planted at 10%, 50% and 90%
depth of a ~1,865-token document; KVzip at budget 512 answers fewer of the early facts than the
full cache. This run shows why without asking anything: for each trial's document (the same
prompts as the table) it prefills KVzip caches, compresses them with the reconstruction pass
(``velox_mlx_lm.kvzip.compress``) for each allocation, and reads which positions every KV head
of every layer kept. Reported, averaged over the trials:

- ``deciles``: the share of (layer, KV head) rows kept in each tenth of the document (the mean
  over the whole document is ``budget / tokens``);
- ``facts``: per planted depth, the share kept at the answer's own tokens (both mentions);
- ``even``: the share a cut that ignored position would keep, ``budget / tokens``;
  ``kept_mean``: the share each allocation kept over the whole document (equal to ``even``:
  every allocation keeps ``budget`` rows per KV head on average).

``python -m velox_bench.quality.kvzip_depth`` writes ``benchmarks/results/kvzip_depth.json`` and
``benchmarks/figures/kvzip_depth.png``; ``--smoke`` is the CI size.
"""

from __future__ import annotations

from velox_blas import preload_openblas

preload_openblas()  # OpenBLAS before mlx when this module is the entry point; harmless otherwise

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from itertools import pairwise  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.quality import corpus, retrieval  # noqa: E402
from velox_bench.quality.methods import KVZIP  # noqa: E402
from velox_bench.quality.run import Progress, environment, run_settings  # noqa: E402
from velox_bench.results import figures_dirs, save_figure, write_json  # noqa: E402
from velox_mlx_lm import KVCacheBuilder  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402
from velox_mlx_lm.kvzip import CHUNK_SIZE, compress, prefill  # noqa: E402

RESULTS_NAME = "kvzip_depth"
N_BINS = 10


@dataclass(frozen=True)
class DepthSettings:
    """One run; the defaults are the retrieval table's documents at its budget."""

    n_trials: int = 6  # the retrieval table's first trials (it runs 30)
    retrieval_tokens: int = 1800  # the document before the facts are planted (as the table)
    budget: int = 512
    allocations: tuple[str, ...] = ("global", "head")
    chunk: int = 256  # prefill step (the table's)
    kvzip_chunk: int = CHUNK_SIZE  # reconstruction chunk (``compress(chunk_size=...)``)
    smoke: bool = False

    @classmethod
    def smoke_run(cls) -> DepthSettings:
        """CI size: one ~250-token document, budget 64, one allocation."""
        return cls(n_trials=1, retrieval_tokens=200, budget=64, allocations=("global",), smoke=True)


def kept_share(caches: Sequence[Any], n: int) -> np.ndarray:
    """``[layers, n]``: per layer, the share of its KV heads that kept each position
    ``0 .. n - 1`` (pad slots, at positions ``>= n``, are not rows of the context)."""
    out = np.zeros((len(caches), n))
    for layer, cache in enumerate(caches):
        positions = np.array(cache.policy_state.positions)[0]  # [H_kv, S], pads >= n
        for row in positions:
            out[layer, row[row < n]] += 1.0 / positions.shape[0]
    return out


def answer_positions(document: Sequence[int], answer: Sequence[int]) -> list[int]:
    """Every position of the document covered by a mention of the ``answer`` tokens."""
    k = len(answer)
    starts = [i for i in range(len(document) - k + 1) if list(document[i : i + k]) == list(answer)]
    if not starts:
        raise ValueError("the answer's tokens do not occur in the document")
    return [s + j for s in starts for j in range(k)]


def evaluate(settings: DepthSettings, loaded: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Compress every trial's document once per allocation; return the JSON-ready shares."""
    started = time.perf_counter()
    model, tokenizer = load_default() if loaded is None else loaded
    encode = tokenizer.encode
    source = corpus.most_recent(1, settings.retrieval_tokens, encode)[0]
    base = retrieval.cut_document(source.text(), settings.retrieval_tokens, encode)
    trials = range(settings.n_trials)
    prompts = [retrieval.build_prompt(tokenizer, base, retrieval.facts(t)) for t in trials]
    n = len(prompts[0].document)
    progress = Progress(3 * n * len(prompts) * len(settings.allocations))
    progress.bar.set_description("kvzip depth")
    bins: dict[str, list[list[float]]] = {a: [] for a in settings.allocations}
    means: dict[str, list[float]] = {a: [] for a in settings.allocations}
    facts: dict[str, dict[str, list[float]]] = {a: {} for a in settings.allocations}
    for prompt in prompts:
        doc = prompt.document
        edges = np.linspace(0, len(doc), N_BINS + 1).astype(int)
        for allocation in settings.allocations:
            variant = replace(KVZIP, settings={"allocation": allocation})
            caches = KVCacheBuilder.for_model(model, variant.config(settings.budget))
            prefill(model, caches, doc, settings.chunk)
            compress(model, tokenizer, caches, doc, chunk_size=settings.kvzip_chunk)
            share = kept_share(caches, len(doc)).mean(axis=0)  # over layers: [n]
            means[allocation].append(float(share.mean()))
            bins[allocation].append([float(share[a:b].mean()) for a, b in pairwise(edges)])
            for depth, answer in zip(retrieval.DEPTHS, prompt.answers, strict=True):
                at = answer_positions(doc, answer)
                facts[allocation].setdefault(f"{depth:.1f}", []).append(float(share[at].mean()))
            del caches
            mx.clear_cache()
            progress.advance(3 * len(doc))
    progress.close()
    return {
        "suite": RESULTS_NAME,
        "smoke": settings.smoke,
        "settings": asdict(settings),
        "environment": environment(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "document": {"source": source.name, "tokens": n, "trials": len(prompts)},
        "even": settings.budget / n,
        "kept_mean": {a: round(float(np.mean(v)), 6) for a, v in means.items()},
        "deciles": {a: np.mean(rows, axis=0).round(4).tolist() for a, rows in bins.items()},
        "facts": {
            a: {d: round(float(np.mean(v)), 4) for d, v in by_depth.items()}
            for a, by_depth in facts.items()
        },
        "facts_per_trial": facts,
    }


def summary(results: dict[str, Any]) -> str:
    """Markdown: the kept share per decile and at the facts, per allocation."""
    doc = results["document"]
    lines = [
        f"KVzip kept share by depth: {doc['trials']} retrieval-table documents of {doc['tokens']} "
        f"tokens, budget {results['settings']['budget']} (an even cut keeps "
        f"{results['even']:.0%} everywhere)",
        "",
        "| allocation | " + " | ".join(f"{10 * i}-{10 * i + 10}%" for i in range(N_BINS)) + " |",
        "| --- |" + " ---: |" * N_BINS,
    ]
    for allocation, row in results["deciles"].items():
        lines.append(f"| {allocation} | " + " | ".join(f"{x:.0%}" for x in row) + " |")
    depths = list(next(iter(results["facts"].values())))
    lines += [
        "",
        "| allocation | " + " | ".join(f"answer at {float(d):.0%}" for d in depths) + " |",
        "| --- |" + " ---: |" * len(depths),
    ]
    for allocation, by_depth in results["facts"].items():
        lines.append(f"| {allocation} | " + " | ".join(f"{by_depth[d]:.0%}" for d in depths) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    """Kept share per decile (lines) and at the answers (markers), per allocation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    centers = (np.arange(N_BINS) + 0.5) / N_BINS
    for i, (allocation, row) in enumerate(results["deciles"].items()):
        color = f"C{i}"
        ax.plot(centers, row, "-", color=color, label=f"{allocation}: whole document")
        by_depth = results["facts"][allocation]
        xs = [float(d) for d in by_depth]
        ax.plot(xs, list(by_depth.values()), "o", color=color, label=f"{allocation}: answers")
    ax.axhline(results["even"], color="black", linestyle="dashed", linewidth=1, label="even cut")
    ax.set_xlabel("depth in the document")
    ax.set_ylabel("share of (layer, KV head) rows kept")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, None)
    doc = results["document"]
    ax.set_title(
        f"KVzip, budget {results['settings']['budget']} of {doc['tokens']} tokens, "
        f"{doc['trials']} documents"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, paths)


def write(results: dict[str, Any]) -> list[Path]:
    """``<results dir>/kvzip_depth.json`` and the figure."""
    path = write_json(RESULTS_NAME, results)
    return [path, *plot(results, [d / f"{RESULTS_NAME}.png" for d in figures_dirs()])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality.kvzip_depth",
        description="Where KVzip's cut keeps rows, by depth, on the retrieval table's documents.",
    )
    parser.add_argument("--smoke", action="store_true", help="the CI size (seconds)")
    parser.add_argument("--trials", type=int, help="documents (default 6)")
    parser.add_argument(
        "--kvzip-chunk", type=int, help=f"reconstruction chunk in tokens (default {CHUNK_SIZE})"
    )
    parser.add_argument("--allocations", nargs="+", help="default: global layer")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    changes = {
        "n_trials": args.trials,
        "kvzip_chunk": args.kvzip_chunk,
        "allocations": tuple(args.allocations) if args.allocations else None,
    }
    settings = DepthSettings.smoke_run() if args.smoke else DepthSettings()
    return run_settings(settings, changes, evaluate, summary, None if args.no_write else write)


if __name__ == "__main__":
    raise SystemExit(main())
