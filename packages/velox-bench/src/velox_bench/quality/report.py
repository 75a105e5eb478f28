"""Tables, figures and docs sections from :func:`velox_bench.quality.run.evaluate` results."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from velox_bench.quality.docs_text import benchmarks_markdown, tova_numbers_markdown
from velox_bench.quality.methods import FULL, TOVA, TOVA_GRID, TOVA_KEY_HEAD
from velox_bench.quality.settings import DEFAULT_MODEL, model_tag
from velox_bench.results import save_figure

RESULTS = Path("benchmarks/results/quality.json")
FIGURES = Path("benchmarks/figures")
DOCS_FIGURES = Path("docs/figures")
BENCHMARKS_DOC = Path("docs/benchmarks.md")
TOVA_DOC = Path("docs/methods/tova.md")
TOVA_PRESET = TOVA.name
TOVA_VARIANTS = tuple(v.name for v in TOVA_GRID)
# The TOVA paper's orderings (Table 3): these rows trail the `tova` preset.
BEHIND_TOVA = {
    "key_head_behind_tova": TOVA_KEY_HEAD.name,
    "h2o_behind_tova": "h2o",
    "streaming_llm_behind_tova": "streaming_llm",
}


def model_of(results: dict[str, Any]) -> str:
    """The embedded model a run measured (runs saved before models had names: SmolLM2)."""
    return str(results["settings"].get("model", DEFAULT_MODEL))


def suffix(results: dict[str, Any]) -> str:
    """``""`` for the default model, whose files keep their plain names; ``"_gemma3-270m"``
    for another: its results, figures and docs section carry its name."""
    return model_tag(model_of(results))


def results_path(results: dict[str, Any]) -> Path:
    """``benchmarks/results/quality.json``, or ``quality_<model>.json`` for another model."""
    return RESULTS.with_name(f"quality{suffix(results)}.json")


def figure_names(results: dict[str, Any]) -> tuple[str, str]:
    """The perplexity and retrieval figures' file names of this run's model."""
    return f"ppl_vs_budget{suffix(results)}.png", f"retrieval{suffix(results)}.png"


def markers(results: dict[str, Any]) -> tuple[str, str]:
    """The docs/benchmarks.md markers around this run's model's quality section."""
    name = "quality" + suffix(results).replace("_", "-")
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _ppl(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    return dict(results["perplexity"]["ppl"])


def perplexity_table(results: dict[str, Any]) -> str:
    """Rows methods, columns budgets then the full cache (TOVA paper, Table 3 layout)."""
    ppl = _ppl(results)
    budgets = [str(b) for b in results["perplexity"]["budgets"]]
    full = ppl[FULL.name]["full"]
    lines = [
        "| Method | " + " | ".join(budgets) + " | full |",
        "| --- | " + " | ".join("---:" for _ in budgets) + " | ---: |",
    ]
    for name, row in ppl.items():
        if name == FULL.name:
            continue
        best = [min(ppl[n][b] for n in ppl if n != FULL.name) for b in budgets]
        cells = [
            f"**{row[b]:.2f}**" if row[b] == best[i] else f"{row[b]:.2f}"
            for i, b in enumerate(budgets)
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {full:.2f} |")
    return "\n".join(lines)


def retrieval_table(results: dict[str, Any]) -> str:
    r = results["retrieval"]
    depths = [f"{d:.1f}" for d in r["depths"]]
    head = " | ".join(f"{float(d):.0%} acc | {float(d):.0%} Δlogp" for d in depths)
    lines = [
        f"| Method | budget | {head} |",
        "| --- | ---: | " + " | ".join("---: | ---:" for _ in depths) + " |",
    ]
    for name, by_budget in r["results"].items():
        for budget, rows in by_budget.items():
            cells = " | ".join(
                f"{rows[d]['accuracy']:.0%} | {rows[d]['logprob_vs_full']:+.2f}" for d in depths
            )
            lines.append(f"| {name} | {budget} | {cells} |")
    return "\n".join(lines)


def _orderings(ppl: dict[str, dict[str, float]], budgets: list[str]) -> dict[str, dict[str, bool]]:
    """Per budget: whether the ``tova`` preset beats every other method, and whether each row
    of :data:`BEHIND_TOVA` that was measured trails it (the paper's Table 3)."""
    tova = ppl[TOVA_PRESET]
    others = [n for n in ppl if n not in (FULL.name, TOVA_PRESET)]
    out = {
        "tova_layer_best_at_every_budget": {
            b: all(tova[b] <= ppl[n][b] for n in others) for b in budgets
        }
    }
    for key, name in BEHIND_TOVA.items():
        if name in ppl:
            out[key] = {b: ppl[name][b] > tova[b] for b in budgets}
    return out


def _tova_variants(
    ppl: dict[str, dict[str, float]], budgets: list[str], full: float
) -> dict[str, Any]:
    """The best TOVA variant (:data:`TOVA_VARIANTS` measured) per budget and overall, by the
    mean over budgets of its perplexity over the full cache's."""
    variants = [n for n in TOVA_VARIANTS if n in ppl]
    per_budget = {b: min(variants, key=lambda n: ppl[n][b]) for b in budgets}
    mean_ratio = {n: sum(ppl[n][b] / full for b in budgets) / len(budgets) for n in variants}
    return {
        "best_tova_variant_per_budget": per_budget,
        "tova_variant_mean_ppl_ratio": mean_ratio,
        "best_tova_variant": min(mean_ratio, key=lambda n: mean_ratio[n]),
    }


def findings(results: dict[str, Any]) -> dict[str, Any]:
    """The paper's ordering checks, T/8 closeness, and the best TOVA variant.

    Checks whose methods were not measured are left out.
    """
    ppl = _ppl(results)
    budgets = [str(b) for b in results["perplexity"]["budgets"]]
    full = ppl[FULL.name]["full"]
    out: dict[str, Any] = {}
    if TOVA_PRESET not in ppl:
        return out
    out.update(_orderings(ppl, budgets))
    tova = ppl[TOVA_PRESET]
    t8 = str(results["perplexity"]["tokens_per_document"] // 8)
    if t8 in tova:
        out["tova_vs_full_at_T_over_8"] = {
            "budget": int(t8),
            "ratio": tova[t8] / full,
            "within_5_percent": tova[t8] <= 1.05 * full,
        }
    out.update(_tova_variants(ppl, budgets, full))
    return out


def summary(results: dict[str, Any]) -> str:
    r = results["retrieval"]
    return "\n\n".join(
        [
            f"BLAS: {results['environment']['blas']}; runtime {results['runtime_s'] / 60:.1f} min",
            "Streaming perplexity (lower is better)\n" + perplexity_table(results),
            f"Retrieval ({r['questions_per_depth']} questions per depth; full-cache exact match "
            f"{r['full_exact_match']:.0%}; measure: {r['measure']})\n" + retrieval_table(results),
            "Findings\n" + json.dumps(findings(results), indent=2),
        ]
    )


def plot_perplexity(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl = _ppl(results)
    budgets = results["perplexity"]["budgets"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in ppl.items():
        if name != FULL.name:
            ax.plot(budgets, [row[str(b)] for b in budgets], marker="o", label=name)
    ax.axhline(ppl[FULL.name]["full"], color="black", linestyle="--", label="full cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("cache budget (tokens per layer)")
    ax.set_ylabel("perplexity")
    p = results["perplexity"]
    ax.set_title(
        f"Streaming perplexity, {results['environment']['model'].split(' (')[0]}, "
        f"{len(p['documents'])} SOTU "
        f"address{'es' if len(p['documents']) != 1 else ''} "
        f"× {p['tokens_per_document']} tokens",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, [path], dpi=120)


def plot_retrieval(results: dict[str, Any], path: Path) -> None:
    """Exact-match accuracy and Δ log-probability against the full cache, per depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = results["retrieval"]
    depths = [f"{d:.1f}" for d in r["depths"]]
    bars = [
        (f"{name} ({budget})" if budget != "full" else name, rows)
        for name, by_budget in r["results"].items()
        for budget, rows in by_budget.items()
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
    width = 0.8 / len(bars)
    panels = (
        ("accuracy", "exact-match accuracy"),
        ("logprob_vs_full", "log p(answer) − full cache (nats)"),
    )
    for ax, (field, label) in zip(axes, panels, strict=True):
        for i, (name, rows) in enumerate(bars):
            values = [rows[d][field] for d in depths]
            ax.bar([j + i * width for j in range(len(depths))], values, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(depths))])
        ax.set_xticklabels([f"fact at {float(d):.0%}" for d in depths])
        ax.set_ylabel(label)
        ax.axhline(0, color="black", linewidth=0.8)
    axes[0].set_ylim(0, 1.05)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    fig.suptitle(
        f"Pass-key retrieval, {results['environment']['model'].split(' (')[0]}, "
        f"{r['document_tokens']}-token document, "
        f"{r['questions_per_depth']} questions per depth (measure: {r['measure']})",
        fontsize=9,
    )
    save_figure(fig, [path], dpi=120)


def replace_between(text: str, start: str, end: str, body: str) -> str:
    """Replace what lies between the two marker lines, adding them at the end if absent."""
    if start not in text or end not in text:
        return text.rstrip("\n") + f"\n\n{start}\n{body}\n{end}\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text, count=1)


def benchmarks_section(results: dict[str, Any]) -> str:
    return benchmarks_markdown(
        results, perplexity_table(results), retrieval_table(results), findings(results)
    )


def write(results: dict[str, Any], root: Path) -> list[Path]:
    """Results JSON, figures (also under docs/figures/) and the docs sections: the default
    model's under the plain names (and the TOVA page's numbers), another model's under names
    that carry it (:func:`suffix`)."""
    written = []
    path = root / results_path(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**results, "findings": findings(results)}, indent=2) + "\n")
    written.append(path)
    (root / FIGURES).mkdir(parents=True, exist_ok=True)
    (root / DOCS_FIGURES).mkdir(parents=True, exist_ok=True)
    ppl_name, retrieval_name = figure_names(results)
    for name, plot in ((ppl_name, plot_perplexity), (retrieval_name, plot_retrieval)):
        plot(results, root / FIGURES / name)
        shutil.copyfile(root / FIGURES / name, root / DOCS_FIGURES / name)
        written += [root / FIGURES / name, root / DOCS_FIGURES / name]
    doc = root / BENCHMARKS_DOC
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if "<!-- perf:start -->" not in text:
        text = text.rstrip("\n") + "\n\n<!-- perf:start -->\n<!-- perf:end -->\n"
    start, end = markers(results)
    text = replace_between(text, start, end, benchmarks_section(results))
    doc.write_text(text)
    written.append(doc)
    tova = root / TOVA_DOC
    if tova.exists() and not suffix(results):
        tova.write_text(
            replace_between(
                tova.read_text(),
                "<!-- quality-numbers:start -->",
                "<!-- quality-numbers:end -->",
                tova_numbers_markdown(results, findings(results)),
            )
        )
        written.append(tova)
    return written
