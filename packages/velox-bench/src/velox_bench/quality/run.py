"""The quality evaluation: the run itself and the command line (settings: ``settings.py``).

Importing this module imports mlx: ``python -m velox_bench.quality`` loads OpenBLAS first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm  # type: ignore[import-untyped]

import velox_blas
from velox_bench.quality import corpus, methods, report, retrieval
from velox_bench.quality.methods import FULL, Variant
from velox_bench.quality.perplexity import perplexity, token_nll
from velox_bench.quality.settings import Settings
from velox_mlx_lm.embedded import MODELS, load

__all__ = ["Settings", "evaluate", "main", "repo_root"]


@dataclass
class Progress:
    """A tqdm bar counted in prefill-token equivalents, with a printed total estimate."""

    total: int
    bar: Any = None
    started: float = field(default_factory=time.perf_counter)
    estimated: bool = False

    def __post_init__(self) -> None:
        self.bar = tqdm(total=self.total, unit="tok", desc="quality", smoothing=0.05)

    def advance(self, n: int) -> None:
        self.bar.update(n)
        done = self.bar.n
        if not self.estimated and done >= 0.03 * self.total:
            self.estimated = True
            elapsed = time.perf_counter() - self.started
            self.bar.write(f"estimated total time: {elapsed * self.total / done / 60:.1f} min")

    def close(self) -> None:
        self.bar.close()


# By variant name, then budget (``"full"`` for the full cache).
_ByRow = dict[str, dict[str, Any]]


def _ppl_budgets(settings: Settings) -> list[int]:
    """The perplexity budgets below T (a budget >= T would equal the full cache)."""
    return [b for b in settings.budgets if b < settings.n_tokens]


def _runs(variants: Sequence[Variant], budgets: Sequence[int]) -> list[tuple[Variant, int]]:
    """The full cache first, then every variant at every budget."""
    return [(FULL, 0)] + [(v, b) for v in variants for b in budgets]


def _budget_key(variant: Variant, budget: int) -> str:
    """A result's key under its variant: ``"full"`` for the full cache, else the budget."""
    return "full" if variant is FULL else str(budget)


def _work(
    settings: Settings, n_ppl: int, n_retrieval: int, prompt_tokens: int, answer_tokens: int
) -> int:
    budgets = _ppl_budgets(settings)
    ppl = settings.n_documents * settings.n_tokens * (1 + n_ppl * len(budgets))
    configs = 1 + n_retrieval * len(settings.retrieval_budgets)
    per_trial = prompt_tokens + answer_tokens
    return ppl + configs * settings.n_trials * per_trial


def _progress(
    settings: Settings, prompts: Sequence[retrieval.Prompt], n_ppl: int, n_retrieval: int
) -> Progress:
    """The bar of a run of ``n_ppl`` perplexity and ``n_retrieval`` retrieval variants."""
    n_prompt = sum(len(p.document) + sum(map(len, p.questions)) for p in prompts) // len(prompts)
    n_answer = sum(sum(map(len, p.answers)) for p in prompts) // len(prompts)
    return Progress(
        _work(
            settings,
            n_ppl=n_ppl,
            n_retrieval=n_retrieval,
            prompt_tokens=n_prompt,
            answer_tokens=n_answer,
        )
    )


def _retrieval_prompts(
    tokenizer: Any, settings: Settings
) -> tuple[corpus.Speech, list[retrieval.Prompt]]:
    """The retrieval document (the most recent address, cut to ``retrieval_tokens``) and one
    prompt per trial, that trial's facts planted in it."""
    encode = tokenizer.encode
    source = corpus.most_recent(1, settings.retrieval_tokens, encode)[0]
    base = retrieval.cut_document(source.text(), settings.retrieval_tokens, encode)
    prompts = [
        retrieval.build_prompt(tokenizer, base, retrieval.facts(trial))
        for trial in range(settings.n_trials)
    ]
    return source, prompts


def _perplexities(
    model: Any,
    encode: Callable[[str], list[int]],
    documents: Sequence[corpus.Speech],
    *,
    variants: Sequence[Variant],
    settings: Settings,
    step: Callable[[int], Any],
) -> tuple[_ByRow, _ByRow]:
    """Streaming perplexity, every variant on the same first T + 1 tokens of each document:
    (over all documents, per document), by variant and budget."""
    budgets = _ppl_budgets(settings)
    nll: dict[str, dict[str, list[np.ndarray]]] = {}
    for doc in documents:
        tokens = encode(doc.text())[: settings.n_tokens + 1]
        for variant, budget in _runs(variants, budgets):
            key = _budget_key(variant, budget)
            scores = token_nll(
                model, variant.config(budget), tokens, chunk=settings.chunk, on_chunk=step
            )
            nll.setdefault(variant.name, {}).setdefault(key, []).append(scores)
    ppl = {
        name: {key: perplexity(np.concatenate(runs)) for key, runs in by_budget.items()}
        for name, by_budget in nll.items()
    }
    per_document = {
        name: {key: [perplexity(r) for r in runs] for key, runs in by_budget.items()}
        for name, by_budget in nll.items()
    }
    return ppl, per_document


def _retrieval_answers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[retrieval.Prompt],
    *,
    variants: Sequence[Variant],
    settings: Settings,
    step: Callable[[int], Any],
    refused: dict[str, str],
) -> dict[str, dict[str, list[list[retrieval.Answer]]]]:
    """Every trial's answers, by variant and budget: the full cache first (it decides the
    measure), then every variant at every retrieval budget. A variant whose cache refuses the
    model (``ValueError``, e.g. KVzip's reconstruction pass past a model's own sliding-window
    caches) goes into ``refused`` with the error's message instead."""
    answers: dict[str, dict[str, list[list[retrieval.Answer]]]] = {}
    for variant, budget in _runs(variants, settings.retrieval_budgets):
        try:
            trials = retrieval.run_trials(
                model,
                variant.config(budget),
                prompts,
                chunk=settings.chunk,
                batch=settings.retrieval_batch,
                on_tokens=step,
                tokenizer=tokenizer,
            )
        except ValueError as exc:  # a method that refuses this model, with its reason
            if variant is FULL:
                raise
            refused[variant.name] = str(exc)
            continue
        answers.setdefault(variant.name, {})[_budget_key(variant, budget)] = trials
    return answers


def _depth_rows(
    trials: Sequence[Sequence[retrieval.Answer]], full: Sequence[Sequence[retrieval.Answer]]
) -> dict[str, dict[str, Any]]:
    """Per depth, the answers of ``trials`` (one per depth each) against the full cache's."""
    rows = {}
    for d, depth in enumerate(retrieval.DEPTHS):
        got = [trial[d] for trial in trials]
        ref = [trial[d] for trial in full]
        rows[f"{depth:.1f}"] = {
            **retrieval.answer_stats(got, ref),
            "correct": [a.correct for a in got],
        }
    return rows


def _retrieval_section(
    source: corpus.Speech,
    prompts: Sequence[retrieval.Prompt],
    answers: dict[str, dict[str, list[list[retrieval.Answer]]]],
    *,
    settings: Settings,
    chat: bool = True,
) -> dict[str, Any]:
    """The results' ``retrieval``: per row and budget, accuracy and log-probability per depth;
    the measure is exact match if the full cache gets at least 80% right, else likelihood.
    ``chat``: whether the questions went through a chat template (else plain text)."""
    full_answers = answers[FULL.name]["full"]
    full_accuracy = float(np.mean([a.correct for trial in full_answers for a in trial]))
    by_depth: dict[str, dict[str, dict[str, Any]]] = {}
    for name, by_budget in answers.items():
        for key, trials in by_budget.items():
            by_depth.setdefault(name, {})[key] = _depth_rows(trials, full_answers)
    return {
        "document": source.name,
        "document_tokens": len(prompts[0].document) if prompts else 0,
        "depths": list(retrieval.DEPTHS),
        "measured_depths": [round(x, 3) for x in np.mean([p.depths for p in prompts], 0)],
        "budgets": list(settings.retrieval_budgets),
        "questions_per_depth": settings.n_trials,
        "full_exact_match": full_accuracy,
        "measure": "exact_match" if full_accuracy >= 0.8 else "likelihood",
        "chat": chat,
        "results": by_depth,
    }


def evaluate(
    settings: Settings,
    perplexity_variants: Sequence[Variant] | None = None,
    retrieval_variants: Sequence[Variant] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Run every measurement of ``settings``; return the JSON-ready results.

    The full cache is always measured first; the variants default to the whole comparison
    (:func:`~velox_bench.quality.methods.perplexity_variants` and ``retrieval_variants``, as
    registered now). ``loaded``: the embedded ``(model, tokenizer)`` of ``settings.model`` if
    already loaded.
    """
    ppl_variants = (
        methods.perplexity_variants() if perplexity_variants is None else perplexity_variants
    )
    ret_variants = (
        methods.retrieval_variants() if retrieval_variants is None else retrieval_variants
    )
    started = time.perf_counter()
    model, tokenizer = load(settings.model) if loaded is None else loaded
    encode = tokenizer.encode
    documents = corpus.most_recent(settings.n_documents, settings.n_tokens + 1, encode)
    source, prompts = _retrieval_prompts(tokenizer, settings)
    progress = _progress(settings, prompts, n_ppl=len(ppl_variants), n_retrieval=len(ret_variants))
    ppl, per_document = _perplexities(
        model, encode, documents, variants=ppl_variants, settings=settings, step=progress.advance
    )
    refused: dict[str, str] = {}
    answers = _retrieval_answers(
        model,
        tokenizer,
        prompts,
        variants=ret_variants,
        settings=settings,
        step=progress.advance,
        refused=refused,
    )
    progress.close()
    retrieval_results = _retrieval_section(
        source,
        prompts,
        answers,
        settings=settings,
        chat=retrieval.has_chat_template(tokenizer),
    )
    retrieval_results["refused"] = refused
    return {
        "settings": asdict(settings),
        "environment": environment(settings.model),
        "runtime_s": round(time.perf_counter() - started, 1),
        "perplexity": {
            "documents": [
                {"name": d.name, "year": d.year, "president": d.president} for d in documents
            ],
            "tokens_per_document": settings.n_tokens,
            "budgets": _ppl_budgets(settings),
            "ppl": ppl,
            "ppl_per_document": per_document,
            "excluded": methods.excluded_from_perplexity(),
        },
        "retrieval": retrieval_results,
    }


def add_retrieval_rows(saved: dict[str, Any], rows: Sequence[Variant]) -> dict[str, Any]:
    """``saved`` (a quality.json) with ``rows`` measured now and added to its retrieval table.

    The run repeats the saved retrieval settings (documents, questions, budgets) with the full
    cache first; its answers must equal the saved full-cache answers exactly (else
    ``ValueError``: the two runs would not be comparable). Perplexity is not measured again
    (``perplexity.excluded`` says why a row has none, as the registry says it now). The
    retrieval rows keep the order of :func:`~velox_bench.quality.methods.retrieval_variants`,
    the full cache first; a row that is not one of them goes last."""
    kept: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in saved["settings"].items()
    }
    settings = Settings(**{**kept, "n_tokens": 8, "n_documents": 1, "budgets": ()})
    fresh = evaluate(settings, perplexity_variants=[], retrieval_variants=rows)
    full_then = saved["retrieval"]["results"][FULL.name]["full"]
    full_now = fresh["retrieval"]["results"][FULL.name]["full"]
    if any(full_now[d]["correct"] != full_then[d]["correct"] for d in full_then):
        raise ValueError("the full cache answers differently from the saved run: not comparable")
    out = json.loads(json.dumps(saved))
    results = out["retrieval"]["results"]
    for row in rows:
        results[row.name] = fresh["retrieval"]["results"][row.name]
    order = [FULL.name, *(v.name for v in methods.retrieval_variants())]
    rank = {name: i for i, name in enumerate(order)}
    out["retrieval"]["results"] = dict(
        sorted(results.items(), key=lambda item: rank.get(item[0], len(order)))
    )
    out["perplexity"]["excluded"] = methods.excluded_from_perplexity()
    out.setdefault("added_rows", []).append(
        {
            "rows": [row.name for row in rows],
            "runtime_s": fresh["runtime_s"],
            "environment": fresh["environment"],
        }
    )
    return out


def run_settings(
    settings: Any,
    changes: dict[str, Any],
    evaluate: Callable[[Any], dict[str, Any]],
    summary: Callable[[dict[str, Any]], str],
    write: Callable[[dict[str, Any]], list[Path]] | None,
) -> int:
    """The end of a quality run's command line: ``settings`` with the ``changes`` that were
    given (``None``: not given), the BLAS in use, the run, its summary, and the files ``write``
    makes (``None``: print only). Returns the exit status."""
    settings = replace(settings, **{k: v for k, v in changes.items() if v is not None})
    print(f"BLAS: {velox_blas.blas_in_use()}")
    results = evaluate(settings)
    print(summary(results))
    for path in write(results) if write is not None else []:
        print(f"wrote {path}")
    return 0


def environment(model: str = "smollm2-135m") -> dict[str, Any]:
    """What a quality run ran on: BLAS, MLX and Python versions, machine, embedded ``model``."""
    return {
        "blas": velox_blas.blas_in_use(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpus()} CPUs",
        "model": f"{MODELS[model].title} (embedded GGUF, dequantized float32)",
    }


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: cwd) holding noxfile.py."""
    here = (start or Path.cwd()).resolve()
    for path in (here, *here.parents):
        if (path / "noxfile.py").is_file():
            return path
    raise FileNotFoundError(f"no noxfile.py at or above {here}: pass --out")


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m velox_bench.quality``."""
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality", description="Velox quality evaluation."
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small run (~3 min)")
    size.add_argument(
        "--full", action="store_true", help=f"{Settings.full_run().describe()} (hours)"
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="the embedded model (default smollm2-135m); another model's results, figures and "
        "docs section carry its name",
    )
    parser.add_argument("--trials", type=int, help="retrieval questions per depth")
    parser.add_argument("--documents", type=int, help="perplexity documents")
    parser.add_argument("--tokens", type=int, help="tokens scored per document (T)")
    parser.add_argument(
        "--out",
        type=Path,
        help="repository root to write results, figures and docs into "
        "(default: this repository for a full run; a quick run writes nothing unless given)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="skip the measurements: rebuild the report from a saved quality.json",
    )
    parser.add_argument(
        "--add-retrieval-rows",
        nargs="+",
        metavar="ROW",
        help="measure only the full cache and these retrieval rows (e.g. kvzip) with the saved "
        "run's settings, check that the full cache answers exactly as in --from-json, add the "
        "rows to it and rebuild the report from it",
    )
    return parser


def _load_saved(path: Path) -> dict[str, Any]:
    """A saved quality.json, its findings left out (the report computes them again)."""
    saved: dict[str, Any] = json.loads(path.read_text())
    saved.pop("findings", None)
    return saved


def _report(results: dict[str, Any], out: Path | None) -> int:
    """Print the summary of ``results`` and write its report into ``out`` (``None``: this
    repository). Returns the exit status."""
    print(report.summary(results))
    for path in report.write(results, out if out is not None else repo_root()):
        print(f"wrote {path}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    """A run with the size and changes given; a quick run writes only where ``--out`` says."""
    settings = (
        Settings.quick_run() if args.quick else Settings.full_run() if args.full else Settings()
    )
    changes = {
        "n_trials": args.trials,
        "n_documents": args.documents,
        "n_tokens": args.tokens,
        "model": args.model,
    }

    def write(results: dict[str, Any]) -> list[Path]:
        out = args.out if args.out is not None else (None if settings.quick else repo_root())
        return [] if out is None else report.write(results, out)

    return run_settings(settings, changes, evaluate, report.summary, write)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.add_retrieval_rows and args.from_json is None:
        parser.error("--add-retrieval-rows needs --from-json (the saved run to add them to)")
    if args.add_retrieval_rows:
        saved = _load_saved(args.from_json)
        rows = [methods.variant(n) for n in args.add_retrieval_rows]
        return _report(add_retrieval_rows(saved, rows), args.out)
    if args.from_json is not None:
        return _report(_load_saved(args.from_json), args.out)
    return _measure(args)
