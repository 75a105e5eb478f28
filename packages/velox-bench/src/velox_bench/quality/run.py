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
from velox_mlx_lm.embedded import load_default

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


def _work(
    settings: Settings, n_ppl: int, n_retrieval: int, prompt_tokens: int, answer_tokens: int
) -> int:
    budgets = [b for b in settings.budgets if b < settings.n_tokens]
    ppl = settings.n_documents * settings.n_tokens * (1 + n_ppl * len(budgets))
    configs = 1 + n_retrieval * len(settings.retrieval_budgets)
    per_trial = prompt_tokens + answer_tokens
    return ppl + configs * settings.n_trials * per_trial


def evaluate(
    settings: Settings,
    perplexity_variants: Sequence[Variant] | None = None,
    retrieval_variants: Sequence[Variant] | None = None,
    loaded: tuple[Any, Any] | None = None,
) -> dict[str, Any]:
    """Run every measurement of ``settings``; return the JSON-ready results.

    The full cache is always measured first; the variants default to the whole comparison
    (:func:`~velox_bench.quality.methods.perplexity_variants` and ``retrieval_variants``, as
    registered now). ``loaded``: the embedded ``(model, tokenizer)`` if already loaded.
    """
    ppl_variants = (
        methods.perplexity_variants() if perplexity_variants is None else perplexity_variants
    )
    ret_variants = (
        methods.retrieval_variants() if retrieval_variants is None else retrieval_variants
    )
    started = time.perf_counter()
    model, tokenizer = load_default() if loaded is None else loaded
    encode = tokenizer.encode
    documents = corpus.most_recent(settings.n_documents, settings.n_tokens + 1, encode)
    source = corpus.most_recent(1, settings.retrieval_tokens, encode)[0]
    base = retrieval.cut_document(source.text(), settings.retrieval_tokens, encode)
    prompts = [
        retrieval.build_prompt(tokenizer, base, retrieval.facts(trial))
        for trial in range(settings.n_trials)
    ]
    n_prompt = sum(len(p.document) + sum(map(len, p.questions)) for p in prompts) // len(prompts)
    n_answer = sum(sum(map(len, p.answers)) for p in prompts) // len(prompts)
    progress = Progress(_work(settings, len(ppl_variants), len(ret_variants), n_prompt, n_answer))

    def step(n: int) -> None:
        progress.advance(n)

    # Perplexity: every variant on the same tokens; budget >= T would equal the full cache.
    budgets = [b for b in settings.budgets if b < settings.n_tokens]
    nll: dict[str, dict[str, list[np.ndarray]]] = {}
    for doc in documents:
        tokens = encode(doc.text())[: settings.n_tokens + 1]
        runs = [(FULL, 0)] + [(v, b) for v in ppl_variants for b in budgets]
        for variant, budget in runs:
            key = "full" if variant is FULL else str(budget)
            scores = token_nll(model, variant.config(budget), tokens, settings.chunk, step)
            nll.setdefault(variant.name, {}).setdefault(key, []).append(scores)
    ppl = {
        name: {key: perplexity(np.concatenate(runs)) for key, runs in by_budget.items()}
        for name, by_budget in nll.items()
    }
    per_document = {
        name: {key: [perplexity(r) for r in runs] for key, runs in by_budget.items()}
        for name, by_budget in nll.items()
    }

    # Retrieval: the full cache first (it decides the measure), then every variant.
    answers: dict[str, dict[str, list[list[retrieval.Answer]]]] = {}
    runs_r = [(FULL, 0)] + [(v, b) for v in ret_variants for b in settings.retrieval_budgets]
    for variant, budget in runs_r:
        key = "full" if variant is FULL else str(budget)

        answers.setdefault(variant.name, {})[key] = retrieval.run_trials(
            model,
            variant.config(budget),
            prompts,
            settings.chunk,
            settings.retrieval_batch,
            step,
            tokenizer=tokenizer,
        )
    progress.close()
    full_answers = answers[FULL.name]["full"]
    full_accuracy = float(np.mean([a.correct for trial in full_answers for a in trial]))
    measure = "exact_match" if full_accuracy >= 0.8 else "likelihood"
    by_depth: dict[str, dict[str, dict[str, Any]]] = {}
    for name, by_budget in answers.items():
        for key, trials in by_budget.items():
            rows = {}
            for d, depth in enumerate(retrieval.DEPTHS):
                got = [trial[d] for trial in trials]
                ref = [trial[d] for trial in full_answers]
                rows[f"{depth:.1f}"] = {
                    "accuracy": float(np.mean([a.correct for a in got])),
                    "logprob": float(np.mean([a.logprob for a in got])),
                    "logprob_vs_full": float(
                        np.mean([a.logprob - r.logprob for a, r in zip(got, ref, strict=True)])
                    ),
                    "correct": [a.correct for a in got],
                }
            by_depth.setdefault(name, {})[key] = rows

    return {
        "settings": asdict(settings),
        "environment": environment(),
        "runtime_s": round(time.perf_counter() - started, 1),
        "perplexity": {
            "documents": [
                {"name": d.name, "year": d.year, "president": d.president} for d in documents
            ],
            "tokens_per_document": settings.n_tokens,
            "budgets": budgets,
            "ppl": ppl,
            "ppl_per_document": per_document,
            "excluded": methods.excluded_from_perplexity(),
        },
        "retrieval": {
            "document": source.name,
            "document_tokens": len(prompts[0].document) if prompts else 0,
            "depths": list(retrieval.DEPTHS),
            "measured_depths": [round(x, 3) for x in np.mean([p.depths for p in prompts], 0)],
            "budgets": list(settings.retrieval_budgets),
            "questions_per_depth": settings.n_trials,
            "full_exact_match": full_accuracy,
            "measure": measure,
            "results": by_depth,
        },
    }


def add_retrieval_rows(saved: dict[str, Any], rows: Sequence[Variant]) -> dict[str, Any]:
    """``saved`` (a quality.json) with ``rows`` measured now and added to its retrieval table.

    The run repeats the saved retrieval settings (documents, questions, budgets) with the full
    cache first; its answers must equal the saved full-cache answers exactly (else
    ``ValueError``: the two runs would not be comparable). Perplexity is not measured again
    (``perplexity.excluded`` says why a row has none)."""
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
    for row in rows:
        out["retrieval"]["results"][row.name] = fresh["retrieval"]["results"][row.name]
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


def environment() -> dict[str, Any]:
    """What a quality run ran on: BLAS, MLX and Python versions, machine, model."""
    return {
        "blas": velox_blas.blas_in_use(),
        "mlx": getattr(mx, "__version__", "unknown"),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpus()} CPUs",
        "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized float32)",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality", description="Velox quality evaluation."
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small run (~3 min)")
    size.add_argument(
        "--full", action="store_true", help=f"{Settings.full_run().describe()} (hours)"
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
    args = parser.parse_args(argv)
    if args.add_retrieval_rows and args.from_json is None:
        parser.error("--add-retrieval-rows needs --from-json (the saved run to add them to)")
    if args.add_retrieval_rows:
        saved = json.loads(args.from_json.read_text())
        saved.pop("findings", None)
        added = add_retrieval_rows(saved, [methods.variant(n) for n in args.add_retrieval_rows])
        print(report.summary(added))
        target = args.out if args.out is not None else repo_root()
        for path in report.write(added, target):
            print(f"wrote {path}")
        return 0
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        saved.pop("findings", None)
        print(report.summary(saved))
        for path in report.write(saved, args.out if args.out is not None else repo_root()):
            print(f"wrote {path}")
        return 0
    settings = (
        Settings.quick_run() if args.quick else Settings.full_run() if args.full else Settings()
    )
    changes = {"n_trials": args.trials, "n_documents": args.documents, "n_tokens": args.tokens}
    settings = Settings(
        **{**asdict(settings), **{k: v for k, v in changes.items() if v is not None}}
    )
    print(f"BLAS: {velox_blas.blas_in_use()}")
    results = evaluate(settings)
    print(report.summary(results))
    out = args.out if args.out is not None else (None if settings.quick else repo_root())
    if out is not None:
        for path in report.write(results, out):
            print(f"wrote {path}")
    return 0
