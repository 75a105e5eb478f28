"""Markdown tables of the performance results, for docs/benchmarks.md.

``python -m velox_bench.report`` prints them from ``benchmarks/results/*.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from velox_bench.results import results_dir

__all__ = ["perf_markdown"]


def _load(directory: Path, suite: str) -> dict[str, Any] | None:
    path = directory / f"{suite}.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _micro(data: dict[str, Any]) -> list[str]:
    ratios: dict[str, dict[str, float]] = data["summary"]["ratio_vs_sdpa"]
    seconds = {(r["config"], r["method"]): r["seconds"] for r in data["rows"]}
    methods = [m for m in next(iter(ratios.values())) if m != "sdpa"]
    lines = [
        "| config | SDPA (µs) | " + " | ".join(methods) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in methods) + " |",
    ]
    for config, by in ratios.items():
        cells = " | ".join(_fmt(by.get(m)) for m in methods)
        lines.append(f"| {config} | {seconds[(config, 'sdpa')] * 1e6:.0f} | {cells} |")
    return lines


def _model(data: dict[str, Any]) -> list[str]:
    rows = data["rows"]
    ratios = data["summary"]["ratios"]
    by = {(r["phase"], r["context"], r["method"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        "| context | method | prefill tok/s | prefill time vs full | decode tok/s | "
        "decode speed-up vs full | vs rotating | KV MiB | peak MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ctx in contexts:
        for m in methods:
            p, d = by.get(("prefill", ctx, m)), by.get(("decode", ctx, m))
            if p is None or d is None:
                continue
            pr = ratios.get(f"prefill-{ctx}", {}).get(m, {})
            dr = ratios.get(f"decode-{ctx}", {}).get(m, {})
            lines.append(
                f"| {ctx} | {m} | {p['tokens_per_s']:.0f} | {_fmt(pr.get('time_vs_full'))} | "
                f"{d['tokens_per_s']:.2f} | {_fmt(dr.get('speedup_vs_full'))} | "
                f"{_fmt(dr.get('speedup_vs_rotating'))} | {d['kv_bytes'] / 2**20:.1f} | "
                f"{d['peak_memory_bytes'] / 2**20:.0f} |"
            )
    return lines


def _prefill(data: dict[str, Any]) -> list[str]:
    exps: dict[str, float] = data["summary"]["loglog_exponent"]
    lines = [
        "| mode | budget | n_sink | exponent of time ~ seq_len^k |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, value in exps.items():
        mode, budget, sink = key.split("-")
        lines.append(f"| {mode} | {budget[6:]} | {sink[4:]} | {value:.2f} |")
    sweep = [r for r in data["rows"] if r.get("kind") == "sweep" and r["n_sink"] == 4]
    lens = sorted({r["seq_len"] for r in sweep})
    t = {(r["mode"], r["budget"], r["seq_len"]): r["seconds"] for r in sweep}
    lines += ["", "| mode | budget | " + " | ".join(f"{n} (ms)" for n in lens) + " |"]
    lines.append("| --- | ---: | " + " | ".join("---:" for _ in lens) + " |")
    for mode, budget in sorted({(r["mode"], r["budget"]) for r in sweep}):
        cells = " | ".join(_fmt(t.get((mode, budget, n), 0) * 1e3, 0) for n in lens)
        lines.append(f"| {mode} | {budget} | {cells} |")
    return lines


def _real_shape(data: dict[str, Any]) -> list[str]:
    ratios = data["summary"]["ratios"]
    by = {(r["dtype"], r["context"], r["method"], r["phase"]): r for r in data["rows"]}
    lines = [
        "| dtype | context | method | prefill s | vs full | vs rotating | peak MiB | "
        "decode ms | speed-up vs full | vs rotating |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype, ctx, m, phase in by:
        if phase != "prefill" or (dtype, ctx, m, "decode") not in by:
            continue
        p, d = by[(dtype, ctx, m, "prefill")], by[(dtype, ctx, m, "decode")]
        pr = ratios.get(f"{dtype}-prefill-{ctx}", {}).get(m, {})
        dr = ratios.get(f"{dtype}-decode-{ctx}", {}).get(m, {})
        lines.append(
            f"| {dtype} | {ctx} | {m} | {p['seconds']:.2f} | {_fmt(pr.get('time_vs_full'))} | "
            f"{_fmt(pr.get('time_vs_rotating'))} | {p['peak_memory_bytes'] / 2**20:.0f} | "
            f"{d['seconds'] * 1e3:.1f} | {_fmt(dr.get('speedup_vs_full'))} | "
            f"{_fmt(dr.get('speedup_vs_rotating'))} |"
        )
    return lines


def _added(data: dict[str, Any]) -> list[str]:
    """A note per later addition of rows (``velox_bench.results.add_rows``): their ratios to
    the saved baselines carry the machine's drift between the runs, which it states."""
    lines = []
    for added in data.get("added_rows", []):
        drift = added.get("baseline_seconds_now_over_saved", {})
        baselines = ", ".join(sorted({k.split()[-1] for k in drift}))
        span = (
            f"the baselines measured alongside ({baselines}) "
            f"took {min(drift.values()):.2f}-{max(drift.values()):.2f}x their saved times, "
            "so these rows' ratios to the saved baselines carry that factor"
            if drift
            else "no baseline was measured alongside"
        )
        lines.append(
            f"Rows of {', '.join(added['methods'])} were added later by a run of those methods "
            f"alone (`VELOX_BENCH_ADD_ROWS`); {span}."
        )
    return [*lines, ""] if lines else []


def _targets(datas: list[dict[str, Any]]) -> list[str]:
    lines = ["| target | measured | bound | met |", "| --- | ---: | ---: | --- |"]
    for data in datas:
        for name, t in data["summary"].get("targets", {}).items():
            met = "yes" if t["met"] else "no"
            lines.append(f"| {name} | {_fmt(t['value'])} | {t['target']} | {met} |")
    return lines


def perf_markdown(directory: Path | None = None) -> str:
    directory = directory or results_dir()
    out: list[str] = []
    suites = ("micro", "prefill", "model", "soak", "real_shape")
    loaded = {s: _load(directory, s) for s in suites}
    datas = [d for d in loaded.values() if d is not None]
    if datas:
        out += ["### Targets", "", *_targets(datas), ""]
    if loaded["micro"]:
        micro = loaded["micro"]
        out += ["### Micro: update time / SDPA time", "", *_micro(micro), "", *_added(micro)]
    if loaded["prefill"]:
        out += ["### Prefill", "", *_prefill(loaded["prefill"]), ""]
    if loaded["model"]:
        out += ["### Model", "", *_model(loaded["model"]), "", *_added(loaded["model"])]
    if loaded["real_shape"]:
        out += ["### Real attention shape", "", *_real_shape(loaded["real_shape"]), ""]
    if loaded["soak"]:
        s = loaded["soak"]["summary"]
        out += [
            "### Soak",
            "",
            f"{s['steps']} decode steps: KV bytes flat at {s['kv_bytes_flat']} B, active memory "
            f"drift {s['active_memory_drift_bytes']} B, median step last/first thousand "
            f"{s['last_over_first']:.2f}.",
            "",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    print(perf_markdown())
