"""Per-suite summaries (ratios, fits, targets) computed from the rows a session measured."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from velox_bench.results import loglog_slope

__all__ = ["TARGETS", "real_shape_table", "summarize"]

# docs/architecture.md (measuring), on the 2-core CPU machine (float32).
TARGETS = {
    "micro_tova_over_sdpa_budget512_hkv8_d128": ("<=", 0.5),
    "prefill_tova_sequential_4096_over_causal_sdpa": ("<=", 3.0),
    "model_8192_tova_decode_speedup_vs_full": (">=", 1.6),
    "model_8192_tova_decode_speedup_vs_rotating": (">=", 0.9),
    "model_8192_tova_prefill_time_vs_full": ("<=", 1.15),
    "model_8192_tova_oneshot_prefill_time_vs_full": ("<=", 1.15),
    # issue 17: random llama with Llama-3.2-1B's attention, chunks of 2048, float32
    "real_4096_tova_prefill_time_vs_full": ("<=", 1.0),
    "real_8192_tova_prefill_time_vs_full": ("<=", 0.6),
    "real_4096_tova_oneshot_prefill_time_vs_rotating": ("<=", 1.1),
    "real_8192_tova_oneshot_prefill_time_vs_rotating": ("<=", 1.1),
    "real_8192_tova_prefill_peak_vs_full": ("<=", 1.0),
    "real_8192_tova_decode_speedup_vs_full": (">=", 2.0),
    "real_8192_tova_decode_speedup_vs_rotating": (">=", 0.9),
}


def _check(name: str, value: float | None) -> dict[str, Any]:
    op, bound = TARGETS[name]
    met = None if value is None else (value <= bound if op == "<=" else value >= bound)
    return {"value": value, "target": f"{op} {bound}", "met": met}


def _micro(rows: list[dict[str, Any]]) -> dict[str, Any]:
    seconds: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        seconds[r["config"]][r["method"]] = r["seconds"]
    ratios: dict[str, dict[str, float]] = {
        config: {m: s / by_method["sdpa"] for m, s in by_method.items()}
        for config, by_method in seconds.items()
        if "sdpa" in by_method
    }
    out: dict[str, Any] = {"ratio_vs_sdpa": dict(ratios)}
    key = "budget512-hkv8-hq32-d128"
    if key in ratios:
        out["targets"] = {
            "micro_tova_over_sdpa_budget512_hkv8_d128": _check(
                "micro_tova_over_sdpa_budget512_hkv8_d128", ratios[key].get("tova_query_layer")
            )
        }
    return out


def _prefill(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[Any, ...], list[tuple[int, float]]] = defaultdict(list)
    sdpa = tova = None
    for r in rows:
        if r.get("kind") == "sweep":
            groups[(r["mode"], r["budget"], r["n_sink"])].append((r["seq_len"], r["seconds"]))
        elif r.get("kind") == "vs_sdpa":
            if r["method"] == "causal_sdpa":
                sdpa = r["seconds"]
            else:
                tova = r["seconds"]
    exponents = {}
    for (mode, budget, n_sink), all_points in sorted(groups.items()):
        # Only prompts that overflow the budget: below it nothing is evicted (a different path).
        points = sorted(p for p in all_points if p[0] > budget)
        if len(points) >= 2:
            exponents[f"{mode}-budget{budget}-sink{n_sink}"] = loglog_slope(
                [p[0] for p in points], [p[1] for p in points]
            )
    out: dict[str, Any] = {"loglog_exponent": exponents}
    if sdpa and tova:
        name = "prefill_tova_sequential_4096_over_causal_sdpa"
        out["tova_sequential_over_causal_sdpa"] = tova / sdpa
        out["targets"] = {name: _check(name, tova / sdpa)}
    return out


def _model(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by[(r["phase"], r["context"])][r["method"]] = r
    ratios: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (phase, ctx), methods in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for method, r in methods.items():
            entry: dict[str, float] = {}
            for base in ("full", "rotating"):
                if base in methods:
                    if phase == "decode":  # speed-up: how many times faster per token
                        entry[f"speedup_vs_{base}"] = methods[base]["seconds"] / r["seconds"]
                    else:  # time ratio: how many times longer to prefill
                        entry[f"time_vs_{base}"] = r["seconds"] / methods[base]["seconds"]
            ratios[f"{phase}-{ctx}"][method] = entry
    out: dict[str, Any] = {"ratios": dict(ratios)}
    d8 = ratios.get("decode-8192", {}).get("tova", {})
    p8 = ratios.get("prefill-8192", {})
    targets = {
        "model_8192_tova_decode_speedup_vs_full": d8.get("speedup_vs_full"),
        "model_8192_tova_decode_speedup_vs_rotating": d8.get("speedup_vs_rotating"),
        "model_8192_tova_prefill_time_vs_full": p8.get("tova", {}).get("time_vs_full"),
        "model_8192_tova_oneshot_prefill_time_vs_full": p8.get("tova_oneshot", {}).get(
            "time_vs_full"
        ),
    }
    out["targets"] = {k: _check(k, v) for k, v in targets.items() if v is not None}
    return out


def _real_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{"<dtype>-<phase>-<context>": {method: ratios}}``: prefill time and peak memory vs
    full/rotating, decode speed-up (how many times faster per token)."""
    by: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        by[f"{r['dtype']}-{r['phase']}-{r['context']}"][r["method"]] = r
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for key, methods in by.items():
        ratios[key] = {}
        for method, r in methods.items():
            entry: dict[str, float] = {}
            for base in ("full", "rotating"):
                if base not in methods:
                    continue
                b = methods[base]
                if r["phase"] == "decode":
                    entry[f"speedup_vs_{base}"] = b["seconds"] / r["seconds"]
                else:
                    entry[f"time_vs_{base}"] = r["seconds"] / b["seconds"]
                    if b["peak_memory_bytes"]:
                        entry[f"peak_vs_{base}"] = r["peak_memory_bytes"] / b["peak_memory_bytes"]
            ratios[key][method] = entry
    return ratios


def _real_shape(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = _real_ratios(rows)

    def get(key: str, method: str, ratio: str) -> float | None:
        return ratios.get(f"float32-{key}", {}).get(method, {}).get(ratio)

    values = {
        "real_4096_tova_prefill_time_vs_full": get("prefill-4096", "tova", "time_vs_full"),
        "real_8192_tova_prefill_time_vs_full": get("prefill-8192", "tova", "time_vs_full"),
        "real_4096_tova_oneshot_prefill_time_vs_rotating": get(
            "prefill-4096", "tova_oneshot", "time_vs_rotating"
        ),
        "real_8192_tova_oneshot_prefill_time_vs_rotating": get(
            "prefill-8192", "tova_oneshot", "time_vs_rotating"
        ),
        "real_8192_tova_prefill_peak_vs_full": get("prefill-8192", "tova", "peak_vs_full"),
        "real_8192_tova_decode_speedup_vs_full": get("decode-8192", "tova", "speedup_vs_full"),
        "real_8192_tova_decode_speedup_vs_rotating": get(
            "decode-8192", "tova", "speedup_vs_rotating"
        ),
    }
    targets = {k: _check(k, v) for k, v in values.items() if v is not None}
    return {"ratios": ratios, "targets": targets}


def real_shape_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text summary of the real-shape suite: one line per dtype, context and method."""
    ratios = _real_ratios(rows)
    by = {(r["dtype"], r["context"], r["method"], r["phase"]): r for r in rows}
    head = (
        f"{'dtype':9}{'ctx':>6} {'method':14}{'prefill s':>10}{'vs full':>8}{'vs rot':>8}"
        f"{'peak MiB':>10}{'decode ms':>10}{'x full':>8}{'x rot':>8}"
    )
    lines = [head]
    for dtype, ctx, method, phase in by:
        if phase != "prefill" or (dtype, ctx, method, "decode") not in by:
            continue
        p, d = by[(dtype, ctx, method, "prefill")], by[(dtype, ctx, method, "decode")]
        pr = ratios[f"{dtype}-prefill-{ctx}"][method]
        dr = ratios[f"{dtype}-decode-{ctx}"][method]

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        lines.append(
            f"{dtype:9}{ctx:>6} {method:14}{p['seconds']:10.2f}{f(pr.get('time_vs_full')):>8}"
            f"{f(pr.get('time_vs_rotating')):>8}{p['peak_memory_bytes'] / 2**20:10.0f}"
            f"{d['seconds'] * 1e3:10.1f}{f(dr.get('speedup_vs_full')):>8}"
            f"{f(dr.get('speedup_vs_rotating')):>8}"
        )
    return "\n".join(lines)


def _soak(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return rows[-1] if rows else {}


def summarize(suite: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    summarizer = {
        "micro": _micro,
        "prefill": _prefill,
        "model": _model,
        "soak": _soak,
        "real_shape": _real_shape,
    }.get(suite)
    return summarizer(rows) if summarizer else {}
