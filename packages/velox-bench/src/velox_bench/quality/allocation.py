"""Adaptive allocation's quality (issue 34): ``uniform``, ``head`` and ``global`` for every policy
that offers them, on the embedded model and real text.

The variants come from the registry: every policy whose ``init`` takes ``allocation`` and
accepts a mode (``velox_cache_core.allocation.shares.ALLOCATIONS``) is run in that mode, so a
policy that gains the setting joins by itself.

- **Perplexity against budget, after a cut.** A real-text document; its first ``prompt_tokens``
  are the prompt, cut once (the policy's prompt end, or KVzip's reconstruction pass), then the
  next ``continuation`` tokens are scored teacher-forced, in one chunk, over the cut cache.
  SnapKV and KVzip append after their cut; TOVA (scope ``head``) cuts at the chunk's first
  token and evicts within the shares token by token, so one chunk scores exactly what token by
  token would. The full cache scores the same tokens.
- **Retrieval by depth.** Pass keys planted at 10%, 50% and 90% of a real document
  (``retrieval.build_prompt``), one question per depth, answered teacher-forced over the cut cache
  (``retrieval.run_trials``); exact-match accuracy per depth and mean log-probability against
  the full cache.
- **Bytes.** The ``nbytes`` each cut holds (summed over layers), against the uniform cut.

``python -m velox_bench.quality.allocation`` (or ``nox -s bench -- allocation_quality``) writes
``benchmarks/results/allocation_quality.json`` and ``benchmarks/figures/allocation_quality.png``.
"""

from __future__ import annotations

from velox_blas import preload_openblas

preload_openblas()  # OpenBLAS before mlx when this module is the entry point; harmless otherwise

import argparse  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.quality import corpus, retrieval  # noqa: E402
from velox_bench.quality.run import Progress, environment  # noqa: E402
from velox_bench.results import figures_dirs, save_figure, smoke, write_json  # noqa: E402
from velox_cache_core import POLICIES  # noqa: E402
from velox_cache_core.allocation.shares import ALLOCATIONS  # noqa: E402
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import DEFAULT_MODEL, load  # noqa: E402
from velox_mlx_lm.kvzip import compress, prefill  # noqa: E402

NAME = "allocation_quality"


@dataclass(frozen=True)
class AllocationSettings:
    """What one run measures (the defaults are the full run: about 40 minutes on 2 CPUs)."""

    budgets: tuple[int, ...] = (64, 128, 256)
    prompt_tokens: int = 1536
    continuation: int = 256
    retrieval_tokens: int = 1000
    retrieval_budget: int = 128
    n_trials: int = 5
    smoke: bool = False
    methods: tuple[str, ...] | None = None  # None: every method with allocation modes
    modes: tuple[str, ...] | None = None  # None: every mode a method accepts
    # (method, allocation) pairs to run, when not every one of ``methods`` x ``modes``
    only: tuple[tuple[str, str], ...] | None = None
    # the pairs retrieval runs (beside the full cache), when not every pair perplexity runs
    retrieval_only: tuple[tuple[str, str], ...] | None = None
    model: str = DEFAULT_MODEL  # an embedded model (velox_mlx_lm.embedded)

    @classmethod
    def smoke_run(cls) -> AllocationSettings:
        """CI size: one budget, a 200-token prompt, one retrieval trial; KVzip in every mode,
        SnapKV (its prompt end cuts) and TOVA (its first single token cuts) uniform and
        ``global`` (the bench checks every mode's bytes against the method's uniform cut);
        retrieval for the ``global`` ones only (the CI time of a run is mostly its questions)."""
        return cls(
            methods=("kvzip", "snapkv", "tova"),
            only=(
                ("kvzip", "uniform"),
                ("kvzip", "head"),
                ("kvzip", "global"),
                ("snapkv", "uniform"),
                ("snapkv", "global"),
                ("tova", "uniform"),
                ("tova", "global"),
            ),
            retrieval_only=(("kvzip", "global"), ("snapkv", "global"), ("tova", "global")),
            budgets=(64,),
            prompt_tokens=200,
            continuation=32,
            retrieval_tokens=200,
            retrieval_budget=64,
            n_trials=1,
            smoke=True,
        )


def _fixed(policy_name: str) -> dict[str, Any]:
    """Settings every run of a policy fixes: scope ``head`` where the policy has a scope (the
    allocation modes share rows across a layer's KV heads, so they need per-head decisions)."""
    params = inspect.signature(POLICIES[policy_name].init).parameters
    return {"scope": "head"} if "scope" in params else {}


def variants() -> list[tuple[str, str]]:
    """``(method, allocation)`` for every method of every registered policy that takes
    ``allocation``, in every mode its ``init`` accepts (a refused mode raises ``ValueError``
    and is left out); policies with a scope run in scope ``head``."""
    out = []
    for name in sorted(POLICIES):
        policy = POLICIES[name]
        if "allocation" not in inspect.signature(policy.init).parameters:
            continue
        for method in policy.methods:
            for mode in ALLOCATIONS:
                try:
                    policy.init_for(method, allocation=mode, **_fixed(name))
                except ValueError:
                    continue
                out.append((method, mode))
    return out


def _config(method: str, allocation: str | None, budget: int) -> KVCacheConfig:
    if allocation is None:
        return KVCacheConfig(method="full")
    policy = next(p for p in POLICIES.values() if method in p.methods).name
    fixed = {f"{policy}_{k}": v for k, v in _fixed(policy).items()}
    settings: dict[str, Any] = {
        f"{policy}_budget": budget,
        f"{policy}_allocation": allocation,
        **fixed,
    }
    return KVCacheConfig(method=method, **settings)


def _cut(model: Any, tokenizer: Any, caches: list[Any], prompt: list[int]) -> None:
    """Fill ``caches`` with ``prompt`` and cut them once: KVzip by its pass; the others as
    generation does, the prompt's last token fed alone (the first single-token call, where
    a held prompt is shared out), then the prompt end."""
    zips = any(
        getattr(c, "layer", None) is not None and c.layer.policy.name == "kvzip" for c in caches
    )
    if zips:
        prefill(model, caches, prompt, step=256)
        compress(model, tokenizer, caches, prompt)
    else:
        prefill(model, caches, prompt[:-1], step=256)
        prefill(model, caches, prompt[-1:], step=1)
    for c in caches:
        if getattr(c, "layer", None) is not None:
            c.finish_prefill()


def continuation_nll(
    model: Any, tokenizer: Any, config: KVCacheConfig, ids: Sequence[int], prompt: int
) -> tuple[float, int]:
    """(mean negative log-likelihood of ``ids[prompt + 1:]``, bytes held after the cut): the
    first ``prompt`` ids cut once, then the rest fed as one chunk."""
    caches = KVCacheBuilder.for_model(model, config)
    _cut(model, tokenizer, caches, list(ids[:prompt]))
    held = sum(int(getattr(c, "nbytes", 0)) for c in caches)
    rest = mx.array(list(ids[prompt:]), dtype=mx.int32)[None]
    logits = model(rest, cache=caches)[0, :-1].astype(mx.float32)
    targets = rest[0, 1:]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1).mean()
    return float(nll.item()), held  # type: ignore[arg-type]


def evaluate(settings: AllocationSettings) -> dict[str, Any]:
    model, tokenizer = load(settings.model)
    encode = tokenizer.encode
    rows = [
        r
        for r in variants()
        if (settings.methods is None or r[0] in settings.methods)
        and (settings.modes is None or r[1] in settings.modes)
        and (settings.only is None or r in settings.only)
    ]
    # retrieval asks its questions through the chat template: a base model has none
    chat = retrieval.has_chat_template(tokenizer)
    n_ppl = (1 + len(rows) * len(settings.budgets)) * (
        settings.prompt_tokens + settings.continuation
    )
    asked = [r for r in rows if settings.retrieval_only is None or r in settings.retrieval_only]
    n_ret = (1 + len(asked)) * settings.n_trials * settings.retrieval_tokens if chat else 0
    progress = Progress(n_ppl + n_ret)
    total = settings.prompt_tokens + settings.continuation
    document = corpus.most_recent(1, total, encode)[0]
    ids = encode(document.text())[:total]
    full_nll, full_bytes = continuation_nll(
        model, tokenizer, KVCacheConfig(method="full"), ids, settings.prompt_tokens
    )
    progress.advance(total)
    perplexity = [
        {
            "method": "full",
            "allocation": None,
            "budget": None,
            "ppl": math.exp(full_nll),
            "kv_bytes": full_bytes,
        }
    ]
    for budget in settings.budgets:
        for method, mode in rows:
            nll, held = continuation_nll(
                model, tokenizer, _config(method, mode, budget), ids, settings.prompt_tokens
            )
            perplexity.append(
                {
                    "method": method,
                    "allocation": mode,
                    "budget": budget,
                    "ppl": math.exp(nll),
                    "kv_bytes": held,
                }
            )
            progress.advance(total)
    by_depth = _retrieval(model, tokenizer, asked, settings, progress) if chat else []
    progress.close()
    return {
        "settings": asdict(settings),
        "environment": environment(settings.model),
        "perplexity": perplexity,
        "retrieval": {"budget": settings.retrieval_budget, "rows": by_depth},
    }


def _retrieval(
    model: Any,
    tokenizer: Any,
    rows: list[tuple[str, str]],
    settings: AllocationSettings,
    progress: Progress,
) -> list[dict[str, Any]]:
    """Exact match by depth and log-probability against the full cache, per variant."""
    encode = tokenizer.encode
    source = corpus.most_recent(1, settings.retrieval_tokens, encode)[0]
    base = retrieval.cut_document(source.text(), settings.retrieval_tokens, encode)
    prompts = [
        retrieval.build_prompt(tokenizer, base, retrieval.facts(t))
        for t in range(settings.n_trials)
    ]
    answers: dict[tuple[str, str | None], list[list[retrieval.Answer]]] = {}
    compared: list[tuple[str, str | None]] = [("full", None), *rows]
    for name, alloc in compared:
        config = _config(name, alloc, settings.retrieval_budget)
        answers[(name, alloc)] = retrieval.run_trials(model, config, prompts, tokenizer=tokenizer)
        progress.advance(settings.n_trials * settings.retrieval_tokens)
    reference = [a for trial in answers[("full", None)] for a in trial]
    by_depth = []
    for (name, alloc), got in answers.items():
        flat = [a for trial in got for a in trial]
        depths = {
            f"{d:.0%}": float(np.mean([trial[i].correct for trial in got]))
            for i, d in enumerate(retrieval.DEPTHS)
        }
        by_depth.append(
            {
                "method": name,
                "allocation": alloc,
                **retrieval.answer_stats(flat, reference),
                "by_depth": depths,
            }
        )
    return by_depth


def _perplexity_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: the continuation's perplexity per budget, and the bytes against uniform."""
    full = rows[0]
    budgets = sorted({r["budget"] for r in rows[1:]})
    lines = [
        f"Perplexity of the continuation after the cut (full cache: {full['ppl']:.3f})",
        "",
        "| method | allocation | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in budgets) + " |",
    ]
    uniform = {
        (r["method"], r["budget"]): r["kv_bytes"] for r in rows[1:] if r["allocation"] == "uniform"
    }
    by_key = {(r["method"], r["allocation"], r["budget"]): r for r in rows[1:]}
    for key in dict.fromkeys((r["method"], r["allocation"]) for r in rows[1:]):
        cells = []
        for b in budgets:
            r = by_key[(key[0], key[1], b)]
            base = uniform.get((key[0], b))  # a run without the method's uniform row: no ratio
            ratio = f" ({r['kv_bytes'] / base:.2f}x bytes)" if base else ""
            cells.append(f"{r['ppl']:.3f}{ratio}")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    return lines


def summary(results: dict[str, Any]) -> str:
    """Markdown tables: perplexity (and bytes against uniform) per budget; retrieval by depth."""
    model = results["settings"].get("model", DEFAULT_MODEL)
    lines = [f"Model: {model}", "", *_perplexity_table(results["perplexity"])]
    ret = results["retrieval"]
    if not ret["rows"]:
        return "\n".join([*lines, "", "Retrieval: not run (the model has no chat template)."])
    depths = list(ret["rows"][0]["by_depth"])
    lines += [
        "",
        f"Retrieval at budget {ret['budget']}: exact match by depth, mean log-probability vs full",
        "",
        "| method | allocation | " + " | ".join(depths) + " | logprob vs full |",
        "| --- | --- | " + " | ".join("---:" for _ in depths) + " | ---: |",
    ]
    for r in ret["rows"]:
        row = " | ".join(f"{r['by_depth'][d]:.0%}" for d in depths)
        lines.append(
            f"| {r['method']} | {r['allocation'] or '-'} | {row} | {r['logprob_vs_full']:+.2f} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], paths: Sequence[Path]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["perplexity"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.axhline(rows[0]["ppl"], color="black", linestyle=":", label="full")
    for key in dict.fromkeys((r["method"], r["allocation"]) for r in rows[1:]):
        pts = sorted(
            (r["budget"], r["ppl"]) for r in rows[1:] if (r["method"], r["allocation"]) == key
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{key[0]} ({key[1]})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (rows per KV head, on average)")
    ax.set_ylabel("perplexity of the continuation")
    model = results["settings"].get("model", DEFAULT_MODEL)
    ax.set_title(f"Allocation modes at equal bytes ({model})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, paths)


def write(results: dict[str, Any]) -> list[Path]:
    """The JSON and the figure; ``allocation_quality`` for the default model,
    ``allocation_quality_<model>`` for another."""
    model = results["settings"].get("model", DEFAULT_MODEL)
    name = NAME if model == DEFAULT_MODEL else f"{NAME}_{model}"
    json_path = write_json(name, results)
    return [json_path, *plot(results, [d / f"{name}.png" for d in figures_dirs()])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the CI size")
    parser.add_argument("--budgets", type=int, nargs="+", help="perplexity budgets")
    parser.add_argument("--trials", type=int, help="retrieval questions per depth")
    parser.add_argument("--prompt-tokens", type=int, help="prompt cut before the continuation")
    parser.add_argument("--methods", nargs="+", help="only these methods (default: every one)")
    parser.add_argument("--modes", nargs="+", help="only these allocation modes")
    parser.add_argument("--model", help=f"an embedded model (default {DEFAULT_MODEL})")
    args = parser.parse_args(argv)
    settings = AllocationSettings.smoke_run() if args.smoke or smoke() else AllocationSettings()
    if args.budgets:
        settings = AllocationSettings(**{**asdict(settings), "budgets": tuple(args.budgets)})
    if args.trials:
        settings = AllocationSettings(**{**asdict(settings), "n_trials": args.trials})
    if args.prompt_tokens:
        settings = AllocationSettings(**{**asdict(settings), "prompt_tokens": args.prompt_tokens})
    for name in ("methods", "modes"):
        if getattr(args, name):
            settings = AllocationSettings(**{**asdict(settings), name: tuple(getattr(args, name))})
    if args.model:
        settings = AllocationSettings(**{**asdict(settings), "model": args.model})
    results = evaluate(settings)
    print(summary(results))
    for path in write(results):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
