"""Figures from the compact results JSON (matplotlib, Agg backend, PNG)."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

from velox_bench.results import figures_dirs, results_dir, save_figure

__all__ = ["plot_all"]


def _load(suite: str, directory: Path) -> dict[str, Any] | None:
    path = directory / f"{suite}.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _series(rows: list[dict[str, Any]], phase: str, key: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r["phase"] == phase:
            out[r["method"]].append((r["context"], r[key]))
    return {m: sorted(points) for m, points in out.items()}


def _line_plot(
    series: dict[str, list[tuple[int, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    path: Path,
    loglog: bool = False,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        style = "--" if name in ("full", "rotating", "causal_sdpa") else "-"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=name)
    if loglog:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    else:
        ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_figure(fig, [path])
    return path


def _real_shape_plot(data: dict[str, Any], path: Path) -> Path:
    """Prefill seconds and decode ms per step vs context, one column per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 8), squeeze=False)
    panels = (("prefill", "prefill time (s)", 1.0), ("decode", "decode step (ms)", 1e3))
    for col, dtype in enumerate(dtypes):
        for row, (phase, ylabel, factor) in enumerate(panels):
            ax = axes[row][col]
            series: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for r in rows:
                if r["dtype"] == dtype and r["phase"] == phase:
                    series[r["method"]].append((r["context"], r["seconds"] * factor))
            for name, points in series.items():
                points.sort()
                style = "--" if name in ("full", "rotating") else "-"
                ax.plot(
                    [p[0] for p in points], [p[1] for p in points], style, marker="o", label=name
                )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{phase}, {dtype}", fontsize=10)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    settings = data["settings"]
    shape = settings.get("shape", {})
    fig.suptitle(
        f"Random llama, {shape.get('heads')}/{shape.get('kv_heads')} heads, head_dim "
        f"{shape.get('head_dim')}, {shape.get('layers')} layers, budget {settings.get('budget')}, "
        f"prefill chunks of {settings.get('prefill_chunk')}",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, [path])
    return path


# The model suite's decode figures: (row key, scale, title, y label, file name).
_MODEL_FIGURES = (
    ("seconds", 1e3, "Decode step latency vs context", "median decode step (ms)", "decode_latency"),
    ("tokens_per_s", 1.0, "Decode tokens/s vs context", "decode tokens/s", "decode_tokens_per_s"),
    (
        "kv_bytes",
        1 / 2**20,
        "KV cache memory vs context (after decode)",
        "KV bytes (MiB)",
        "kv_memory",
    ),
)


def _model_plots(model: dict[str, Any], out_dir: Path) -> list[Path]:
    """Decode step latency, decode tokens/s and KV memory vs context, from the model suite."""
    rows = model["rows"]
    note = f"\n{model['settings'].get('model', '')}, budget {model['settings'].get('budget')}"
    written = []
    for key, scale, title, ylabel, name in _MODEL_FIGURES:
        series = {
            m: [(c, v * scale) for c, v in points]
            for m, points in _series(rows, "decode", key).items()
        }
        written.append(
            _line_plot(
                series,
                title=title + note,
                xlabel="context (tokens)",
                ylabel=ylabel,
                path=out_dir / f"{name}.png",
            )
        )
    return written


def _prefill_plot(prefill: dict[str, Any], out_dir: Path) -> Path:
    """TOVA's prefill time vs prompt length (n_sink 4), one line per mode and budget, log-log."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in prefill["rows"]:
        if r.get("kind") == "sweep" and r["n_sink"] == 4:
            series[f"{r['mode']} budget {r['budget']}"].append((r["seq_len"], r["seconds"]))
    return _line_plot(
        {k: sorted(v) for k, v in sorted(series.items())},
        title="TOVA prefill time vs prompt length (n_sink 4, log-log)",
        xlabel="prompt length (tokens)",
        ylabel="seconds",
        path=out_dir / "prefill_loglog.png",
        loglog=True,
    )


def plot_all(directory: Path | None = None) -> list[Path]:
    """Write every figure the available results allow; returns the paths written."""
    directory = directory or results_dir()
    targets = figures_dirs()
    out_dir = targets[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    model = _load("model", directory)
    if model and model["rows"]:
        written += _model_plots(model, out_dir)
    prefill = _load("prefill", directory)
    if prefill and prefill["rows"]:
        written.append(_prefill_plot(prefill, out_dir))
    real = _load("real_shape", directory)
    if real and real["rows"]:
        written.append(_real_shape_plot(real, out_dir / "real_shape.png"))
    for extra in targets[1:]:
        extra.mkdir(parents=True, exist_ok=True)
        for path in written:
            shutil.copyfile(path, extra / path.name)
    return written
