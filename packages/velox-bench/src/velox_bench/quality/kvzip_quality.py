"""KVzip's quality run: many questions about one document that is compressed once.

One real-text document gets ``facts_per_depth`` planted pass keys around each of the
retrieval depths (10%, 50%, 90%; ``retrieval.Fact``, every city once), so one document carries
all the questions (30 by default). KVzip prefills it, compresses it once by the reconstruction
pass, saves it with mlx-lm's ``save_prompt_cache``, and every question is answered from a fresh
``load_prompt_cache`` of that file (``retrieval.ask``: teacher-forced, exact match and
log-probability). The full cache, ``kvzip (latest)`` (the last context query's cut, compressed
once the same way), ``kvzip (head)`` and ``kvzip (uniform)`` (the other ways to share the
rows out: by head within each layer, or exactly ``budget`` per head; ``kvzip`` itself is the
paper's global threshold, rounded to whole lanes) and the retrieval table's policies answer
the same questions at the same budget; those run as in the retrieval table
(``retrieval.run_trials``: the document prefilled once, each question from a copy of its
cache; SnapKV compresses with each question's window).

Cost: in each of ``timing_rounds`` rounds (order alternating) a plain full-cache prefill of the
document, then KVzip's own prefill and its scoring pass (``velox_mlx_lm.kvzip.compress``), each
evaluated; medians side by side, and the median of the per-round ratios.

Goal (issue 18): at every depth, KVzip's exact-match accuracy at least 80% of the full cache's.

``python -m velox_bench.quality.kvzip_quality`` (or ``nox -s bench -- kvzip_quality``) writes
``benchmarks/results/kvzip_quality.json`` and ``benchmarks/figures/kvzip_quality.png``.
"""

from __future__ import annotations

from velox_blas import preload_openblas

preload_openblas()  # OpenBLAS before mlx when this module is the entry point; harmless otherwise

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache  # noqa: E402

from velox_bench.quality import corpus, methods, retrieval  # noqa: E402
from velox_bench.quality.methods import FULL, KVZIP, Variant  # noqa: E402
from velox_bench.quality.run import Progress, environment, run_settings  # noqa: E402
from velox_bench.results import figures_dirs, save_figure, smoke, write_json  # noqa: E402
from velox_mlx_lm import KVCacheBuilder  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402
from velox_mlx_lm.kvzip import compress, prefill  # noqa: E402

__all__ = [
    "GOAL",
    "KVZIP",
    "KVZIP_BY_HEAD",
    "KVZIP_LATEST",
    "KVZIP_UNIFORM",
    "KVzipQualitySettings",
    "build_document",
    "evaluate",
    "main",
    "plot",
    "summary",
    "write",
]

KVZIP_LATEST = Variant("kvzip (latest)", "kvzip", {"probe": "latest"})
# The other ways to share the rows out (KVZIP: "global", the paper's default).
KVZIP_BY_HEAD = Variant("kvzip (head)", "kvzip", {"allocation": "head"})
KVZIP_UNIFORM = Variant("kvzip (uniform)", "kvzip", {"allocation": "uniform"})
GOAL = 0.8  # KVzip's accuracy / the full cache's, at every depth
RESULTS_NAME = "kvzip_quality"


@dataclass(frozen=True)
class KVzipQualitySettings:
    """One run. The defaults are the issue's setting: budget 512 of a ~1,865-token document,
    30 questions (10 per depth)."""

    document_tokens: int = 1865  # the planted document's length, about (facts included)
    facts_per_depth: int = 10
    depths: tuple[float, ...] = retrieval.DEPTHS
    spread: float = 0.1  # the facts of one depth sit within depth +- spread / 2
    budget: int = 512
    chunk: int = 512  # prefill step
    kvzip_chunk: int = 512  # reconstruction chunk (``compress(chunk_size=...)``)
    timing_rounds: int = 3
    compare: tuple[str, ...] | None = None  # retrieval-table rows by name; None: all of them
    seed: int = 0
    smoke: bool = False

    @classmethod
    def smoke_run(cls) -> KVzipQualitySettings:
        """CI size: a ~150-token document, two questions, two reconstruction chunks."""
        return cls(
            document_tokens=150,
            facts_per_depth=1,
            depths=(0.1, 0.9),
            budget=48,
            chunk=64,
            kvzip_chunk=96,
            timing_rounds=1,
            compare=(methods.TOVA.name,),
            smoke=True,
        )

    def fact_depths(self) -> list[float]:
        """Where each fact is planted (relative depth), depth-major."""
        k = self.facts_per_depth
        offsets = [self.spread * (j / (k - 1) - 0.5) for j in range(k)] if k > 1 else [0.0]
        return [min(1.0, max(0.0, d + o)) for d in self.depths for o in offsets]


def many_facts(n: int, seed: int = 0) -> tuple[retrieval.Fact, ...]:
    """``n`` facts with ``n`` different cities (at most ``len(retrieval.CITIES)``)."""
    if not 1 <= n <= len(retrieval.CITIES):
        raise ValueError(f"need 1 <= facts <= {len(retrieval.CITIES)} (one city each), got {n}")
    rng = random.Random(2000 + seed)
    cities = rng.sample(retrieval.CITIES, n)
    return tuple(retrieval.Fact(city, rng.randrange(10_000, 100_000)) for city in cities)


def build_document(
    tokenizer: Any, text: str, settings: KVzipQualitySettings
) -> tuple[retrieval.Prompt, list[float]]:
    """The prompt (one document, every question) and each question's nominal depth."""
    where = settings.fact_depths()
    planted = many_facts(len(where), settings.seed)
    encode = tokenizer.encode
    fact_tokens = sum(len(encode(" " + f.sentence(), add_special_tokens=False)) for f in planted)
    room = settings.document_tokens - fact_tokens
    if room < 16:
        raise ValueError(f"document_tokens={settings.document_tokens} leaves no room for text")
    base = retrieval.cut_document(text, room, encode)
    prompt = retrieval.build_prompt(tokenizer, base, planted, where)
    nominal = [d for d in settings.depths for _ in range(settings.facts_per_depth)]
    return prompt, nominal


def _ask_all(
    model: Any, fresh: Callable[[], list[Any]], prompt: retrieval.Prompt, step: Callable[[int], Any]
) -> list[retrieval.Answer]:
    out = []
    for q, a in zip(prompt.questions, prompt.answers, strict=True):
        out += retrieval.ask(model, fresh(), mx.array([q]), mx.array([a]))
        step(len(q) + len(a))
    return out


def _load(path: str) -> list[Any]:
    return list(load_prompt_cache(path))


def _compressed(
    model: Any, tokenizer: Any, variant: Variant, doc: list[int], s: KVzipQualitySettings
) -> tuple[list[Any], dict[str, Any], float, float]:
    """KVzip caches of ``doc`` compressed once: (caches, info, prefill s, compress s)."""
    caches = KVCacheBuilder.for_model(model, variant.config(s.budget))
    start = time.perf_counter()
    prefill(model, caches, doc, s.chunk)
    filled = time.perf_counter()
    info = compress(model, tokenizer, caches, doc, chunk_size=s.kvzip_chunk)
    done = time.perf_counter()
    kept = [c.tokens_kept for c in caches]  # real rows per head (pad slots left out)
    info["kept_rows"] = round(sum(kept) / len(kept), 1)  # per head, averaged over the layers
    info["kept_rows_max_layer"] = max(kept)
    info["kv_bytes"] = sum(c.nbytes for c in caches)  # pad slots included: they are held
    return caches, info, filled - start, done - filled


def _timed_full_prefill(model: Any, doc: list[int], s: KVzipQualitySettings) -> float:
    caches = KVCacheBuilder.for_model(model, FULL.config(0))
    start = time.perf_counter()
    prefill(model, caches, doc, s.chunk)  # evaluates the caches after every step
    return time.perf_counter() - start


def _by_depth(
    got: Sequence[retrieval.Answer],
    ref: Sequence[retrieval.Answer],
    nominal: Sequence[float],
    measured: Sequence[float],
) -> dict[str, dict[str, Any]]:
    rows = {}
    for depth in sorted(set(nominal)):
        idx = [i for i, d in enumerate(nominal) if d == depth]
        rows[f"{depth:.1f}"] = {
            **retrieval.answer_stats([got[i] for i in idx], [ref[i] for i in idx]),
            "measured_depth": round(float(np.mean([measured[i] for i in idx])), 3),
            "correct": [got[i].correct for i in idx],
        }
    return rows


# A variant compressed once: its caches and what ``compress`` reported (see ``_compressed``).
_Compressed = tuple[Variant, list[Any], dict[str, Any]]


def _compare(settings: KVzipQualitySettings) -> list[Variant]:
    """The retrieval-table rows ``settings.compare`` names (all if ``None``; KVzip itself runs
    apart); ``KeyError`` on a name the table does not have."""
    known = [v for v in methods.retrieval_variants() if v is not KVZIP]
    compare = (
        known if settings.compare is None else [v for v in known if v.name in settings.compare]
    )
    if settings.compare is not None and len(compare) != len(settings.compare):
        names = ", ".join(v.name for v in known)
        raise KeyError(f"unknown row in compare={settings.compare}; known: {names}")
    return compare


def _progress(settings: KVzipQualitySettings, prompt: retrieval.Prompt, n_compare: int) -> Progress:
    """The bar of the whole run, in prefill-token equivalents (a scoring pass feeds about one
    document)."""
    n = len(prompt.document)
    asked = sum(map(len, prompt.questions)) + sum(map(len, prompt.answers))
    total = settings.timing_rounds * 3 * n + 5 * n + (1 + n_compare) * n
    total += (5 + n_compare) * asked
    progress = Progress(total)
    progress.bar.set_description("kvzip quality")
    return progress


def _timed_kvzip(
    model: Any,
    tokenizer: Any,
    doc: list[int],
    *,
    settings: KVzipQualitySettings,
    progress: Progress,
) -> tuple[list[dict[str, float]], _Compressed]:
    """The cost, side by side: per round a plain prefill vs KVzip's prefill and scoring pass,
    order alternating, after an untimed warm-up of both on the document's first chunk.
    (Seconds per round, KVzip compressed by the last round; compressed once anyway if none.)"""
    n = len(doc)
    head = doc[: min(n, settings.chunk)]
    _timed_full_prefill(model, head, settings)
    _compressed(model, tokenizer, KVZIP, head, settings)
    rounds: list[dict[str, float]] = []
    zipped: list[Any] = []
    info: dict[str, Any] = {}
    for r in range(settings.timing_rounds):
        row: dict[str, float] = {}
        for part in ("full", "kvzip") if r % 2 == 0 else ("kvzip", "full"):
            if part == "full":
                row["full_prefill_s"] = _timed_full_prefill(model, doc, settings)
                progress.advance(n)
            else:
                zipped, info, row["kvzip_prefill_s"], row["kvzip_scoring_s"] = _compressed(
                    model, tokenizer, KVZIP, doc, settings
                )
                progress.advance(2 * n)
        rounds.append(row)
        mx.clear_cache()
    if not zipped:  # timing_rounds=0: compress once anyway
        zipped, info, _, _ = _compressed(model, tokenizer, KVZIP, doc, settings)
    return rounds, (KVZIP, zipped, info)


def _other_compressions(
    model: Any,
    tokenizer: Any,
    doc: list[int],
    *,
    settings: KVzipQualitySettings,
    progress: Progress,
) -> list[_Compressed]:
    """KVzip's other variants (the last context query's cut, per layer, per head), each
    compressed once."""
    out = []
    for variant, passes in ((KVZIP_LATEST, 1), (KVZIP_BY_HEAD, 2), (KVZIP_UNIFORM, 2)):
        caches, info, _, _ = _compressed(model, tokenizer, variant, doc, settings)
        out.append((variant, caches, info))
        progress.advance(passes * len(doc))
    return out


def _answers_from_saved(
    model: Any, prompt: retrieval.Prompt, compressed: Sequence[_Compressed], *, progress: Progress
) -> dict[str, list[retrieval.Answer]]:
    """Each compressed variant's answers: its caches saved once, every question answered from
    a fresh load of that file."""
    answers: dict[str, list[retrieval.Answer]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, caches, _ in compressed:
            path = str(Path(tmp) / f"{variant.method}-{len(answers)}.safetensors")
            save_prompt_cache(path, caches)  # compressed once; every question loads it afresh
            answers[variant.name] = _ask_all(model, partial(_load, path), prompt, progress.advance)
    return answers


def _table_answers(
    model: Any,
    prompt: retrieval.Prompt,
    variants: Sequence[Variant],
    *,
    settings: KVzipQualitySettings,
    progress: Progress,
) -> dict[str, list[retrieval.Answer]]:
    """``variants`` answered as in the retrieval table (``retrieval.run_trials``: the document
    prefilled once, each question from a copy of its cache)."""
    answers = {}
    for variant in variants:
        config = variant.config(settings.budget)
        answers[variant.name] = retrieval.run_trials(
            model, config, [prompt], chunk=settings.chunk, batch=1, on_tokens=progress.advance
        )[0]
        mx.clear_cache()
    return answers


def _goal(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per depth: KVzip's accuracy against :data:`GOAL` times the full cache's."""
    goal = {}
    for depth, row in results[KVZIP.name].items():
        ref = results[FULL.name][depth]["accuracy"]
        goal[depth] = {
            "full": ref,
            "kvzip": row["accuracy"],
            "ratio": row["accuracy"] / ref if ref > 0 else None,
            "met": row["accuracy"] >= GOAL * ref,
        }
    return goal


def _cost(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """The timing rounds, their medians and the median per-round scoring / prefill ratio."""
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} if rounds else {}
    return {
        "rounds": rounds,
        "median_s": medians,
        "scoring_over_prefill": (
            statistics.median(r["kvzip_scoring_s"] / r["full_prefill_s"] for r in rounds)
            if rounds
            else None
        ),
    }


def evaluate(
    settings: KVzipQualitySettings, loaded: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Run ``settings``; return the JSON-ready results (see the module docstring)."""
    started = time.perf_counter()
    model, tokenizer = load_default() if loaded is None else loaded
    source = corpus.most_recent(1, settings.document_tokens, tokenizer.encode)[0]
    prompt, nominal = build_document(tokenizer, source.text(), settings)
    doc = prompt.document
    compare = _compare(settings)
    progress = _progress(settings, prompt, n_compare=len(compare))
    rounds, zipped = _timed_kvzip(model, tokenizer, doc, settings=settings, progress=progress)
    others = [
        zipped,
        *_other_compressions(model, tokenizer, doc, settings=settings, progress=progress),
    ]
    answers = _answers_from_saved(model, prompt, others, progress=progress)
    kept = {
        v.name: {k: i[k] for k in ("kept_rows", "kept_rows_max_layer", "kv_bytes")}
        for v, _, i in others
    }
    info, latest_info = zipped[2], others[1][2]
    del zipped, others  # the compressed caches: free before the table's rows run
    answers.update(
        _table_answers(model, prompt, (FULL, *compare), settings=settings, progress=progress)
    )
    progress.close()

    full = answers[FULL.name]
    results = {name: _by_depth(got, full, nominal, prompt.depths) for name, got in answers.items()}
    goal = _goal(results)
    return {
        "suite": RESULTS_NAME,
        "smoke": settings.smoke,
        "settings": asdict(settings),
        "environment": environment(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "document": {
            "source": source.name,
            "tokens": len(doc),
            "questions": len(prompt.questions),
            "questions_per_depth": settings.facts_per_depth,
            "fact_depths": [round(d, 3) for d in prompt.depths],
        },
        "kvzip": {**info, "budget": settings.budget, "chunk_size": settings.kvzip_chunk},
        "kvzip_latest": {**latest_info, "budget": settings.budget},
        "kept": kept,  # per compressed variant: real rows per head (mean, fullest layer), bytes
        "cost": _cost(rounds),
        "results": results,
        "goal": {"threshold": GOAL, "per_depth": goal, "met": all(g["met"] for g in goal.values())},
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def summary(results: dict[str, Any]) -> str:
    """Markdown: accuracy per depth per row, KVzip's goal, and the cost of the scoring pass."""
    depths = list(results["results"][FULL.name])
    doc = results["document"]
    head = (
        f"KVzip, one compressed document: {doc['tokens']} tokens ({doc['source']}), "
        f"{doc['questions']} questions ({doc['questions_per_depth']} per depth), "
        f"budget {results['kvzip']['budget']}; BLAS: {results['environment']['blas']}"
    )
    lines = [
        head,
        "",
        "| cache | "
        + " | ".join(f"{float(d):.0%} depth" for d in depths)
        + " | mean log p vs full |",
        "| --- |" + " ---: |" * (len(depths) + 1),
    ]
    for name, rows in results["results"].items():
        cells = [
            f"{_pct(rows[d]['accuracy'])} ({sum(rows[d]['correct'])}/{len(rows[d]['correct'])})"
            for d in depths
        ]
        mean_lp = float(np.mean([rows[d]["logprob_vs_full"] for d in depths]))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean_lp:+.2f} |")
    kept = results.get("kept", {})
    if kept:
        lines += [
            "",
            "| compressed once | rows per head (mean) | fullest layer | KV bytes held |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, k in kept.items():
            lines.append(
                f"| {name} | {k['kept_rows']} | {k['kept_rows_max_layer']} | "
                f"{k['kv_bytes'] / 1e6:.2f} MB |"
            )
    goal = results["goal"]
    per = ", ".join(
        f"{float(d):.0%}: {_pct(g['ratio'])} of full ({'met' if g['met'] else 'NOT met'})"
        for d, g in goal["per_depth"].items()
    )
    lines += [
        "",
        f"Goal (KVzip >= {goal['threshold']:.0%} of the full cache at every depth): {per}.",
    ]
    cost = results["cost"]
    if cost["rounds"]:
        m = cost["median_s"]
        lines.append(
            f"Cost (medians of {len(cost['rounds'])} rounds): plain prefill "
            f"{m['full_prefill_s']:.2f} s, KVzip prefill {m['kvzip_prefill_s']:.2f} s, "
            f"scoring pass {m['kvzip_scoring_s']:.2f} s "
            f"({results['kvzip']['scored_tokens']} tokens in {results['kvzip']['chunks']} chunks); "
            f"scoring / plain prefill = {cost['scoring_over_prefill']:.2f}x (median of per-round "
            "ratios)."
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    """Accuracy per depth per row (the goal marked on KVzip's bars) and the cost medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    depths = list(rows[FULL.name])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(rows)
    for i, (name, by_depth) in enumerate(rows.items()):
        xs = np.arange(len(depths)) + (i - (len(rows) - 1) / 2) * width
        ax.bar(xs, [by_depth[d]["accuracy"] for d in depths], width, label=name)
    full = [rows[FULL.name][d]["accuracy"] * results["goal"]["threshold"] for d in depths]
    for j, y in enumerate(full):
        ax.hlines(y, j - 0.45, j + 0.45, colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks(np.arange(len(depths)), [f"{float(d):.0%}" for d in depths])
    ax.set_xlabel("depth of the fact in the document")
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1.05)
    doc = results["document"]
    ax.set_title(
        f"{doc['questions']} questions, one document ({doc['tokens']} tokens), "
        f"budget {results['kvzip']['budget']}; dashed: {results['goal']['threshold']:.0%} of full"
    )
    ax.legend(fontsize=7, ncol=2)
    cost = results["cost"]
    if cost["rounds"]:
        keys = ["full_prefill_s", "kvzip_prefill_s", "kvzip_scoring_s"]
        labels = ["plain\nprefill", "KVzip\nprefill", "KVzip\nscoring"]
        bx.bar(labels, [cost["median_s"][k] for k in keys], color=["gray", "tab:blue", "tab:red"])
        for k, label in zip(keys, labels, strict=True):
            bx.plot([label] * len(cost["rounds"]), [r[k] for r in cost["rounds"]], "k.")
        bx.set_ylabel("seconds (bars: medians, dots: rounds)")
        bx.set_title(f"scoring / prefill = {cost['scoring_over_prefill']:.2f}x")
    fig.tight_layout()
    return save_figure(fig, paths)


def write(results: dict[str, Any]) -> list[Path]:
    """``<results dir>/kvzip_quality.json`` and the figure (``VELOX_BENCH_RESULTS_DIR`` moves
    both, as for the other suites)."""
    path = write_json(RESULTS_NAME, results)
    return [path, *plot(results, [d / f"{RESULTS_NAME}.png" for d in figures_dirs()])]


def settings_from_env() -> KVzipQualitySettings:
    """``VELOX_BENCH_SMOKE=1``: the CI size; otherwise the defaults."""
    return KVzipQualitySettings.smoke_run() if smoke() else KVzipQualitySettings()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality.kvzip_quality",
        description="KVzip: one document compressed once, many questions.",
    )
    parser.add_argument("--smoke", action="store_true", help="the CI size (seconds)")
    parser.add_argument("--facts-per-depth", type=int, help="questions per depth (default 10)")
    parser.add_argument("--budget", type=int, help="rows per KV head (default 512)")
    parser.add_argument("--rounds", type=int, help="timing rounds (default 3)")
    parser.add_argument(
        "--compare", nargs="*", help="retrieval-table rows to compare (default: all)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    changes = {
        "facts_per_depth": args.facts_per_depth,
        "budget": args.budget,
        "timing_rounds": args.rounds,
        "compare": tuple(args.compare) if args.compare is not None else None,
    }
    settings = KVzipQualitySettings.smoke_run() if args.smoke else KVzipQualitySettings()
    return run_settings(settings, changes, evaluate, summary, None if args.no_write else write)


if __name__ == "__main__":
    raise SystemExit(main())
