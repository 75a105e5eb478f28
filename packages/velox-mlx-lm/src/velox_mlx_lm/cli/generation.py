"""One generation with stats, and the plain-text tables ``velox-generate`` prints."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Run:
    label: str
    answer: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


def kv_stats(caches: list[Any]) -> dict[str, Any]:
    from velox_mlx_lm.pins import pinned_tokens, velox_layers
    from velox_mlx_lm.serve.cache import kept_bytes, kept_rows, layer_roles

    kept = [kept_rows(c) for c in caches]
    ratios = [float(getattr(c, "compression_ratio", 1.0)) for c in caches]
    return {
        "tokens_kept_per_layer": max(kept) if kept else 0,
        "pinned_tokens": pinned_tokens(caches),
        "demoted_tokens": max((c.demoted_tokens for c in velox_layers(caches)), default=0),
        "compression_ratio": max(ratios) if ratios else 1.0,
        "kv_bytes": sum(kept_bytes(c) for c in caches),
        **layer_roles(caches),
    }


def quant_stats(config: Any) -> dict[str, Any]:
    """How a run's cache is quantized: ``kv_bits`` and the key layout (``None``: the model's
    precision, no layout)."""
    bits = config.kv_bits
    return {"kv_bits": bits, "kv_key_layout": None if bits is None else config.kv_key_layout}


def quantized(config: Any) -> dict[str, Any]:
    """:func:`quant_stats` for a ``--json`` config: only when the rows are quantized (an
    unquantized run's config lists its method settings alone, as before)."""
    return {} if config.kv_bits is None else quant_stats(config)


def generate_once(
    model: Any,
    tokenizer: Any,
    prompt: list[int],
    caches: list[Any],
    args: argparse.Namespace,
    label: str,
    echo: bool,
    draft: tuple[Any, list[Any]] | None = None,
) -> Run:
    """One generation; with ``draft`` (draft model, its caches) speculatively."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm  # type: ignore[import-untyped]

    mx.random.seed(args.seed)
    mx.reset_peak_memory()
    bar = tqdm(
        total=len(prompt),
        desc=f"prefill ({label})",
        unit="tok",
        file=sys.stderr,
        disable=args.json or len(prompt) <= args.prefill_step_size,
        leave=True,  # the full bar stays on its line; the answer starts below it
    )

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    if echo:
        print(f"\n=== {label} ===", flush=True)
    run = Run(label)
    last = None
    accepted = 0
    speculative: dict[str, Any] = {}
    if draft is not None:
        speculative = {
            "draft_model": draft[0],
            "num_draft_tokens": args.num_draft_tokens,
        }
    for response in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp),
        prompt_cache=caches if draft is None else caches + draft[1],
        prefill_step_size=args.prefill_step_size,
        prompt_progress_callback=progress,
        **speculative,
    ):
        if last is None:  # the prompt is in: the bar reaches its total and goes
            _finish(bar)
        run.answer += response.text
        accepted += bool(getattr(response, "from_draft", False))
        last = response
        if echo:
            print(response.text, end="", flush=True)
    _finish(bar)
    if echo:
        print(flush=True)
    assert last is not None
    run.stats = {
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
        "prefill_tokens_per_s": round(last.prompt_tps, 2),
        "decode_tokens_per_s": round(last.generation_tps, 2),
        **kv_stats(caches),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
    }
    if draft is not None:
        run.stats["draft_tokens_accepted"] = accepted
    return run


def _finish(bar: Any) -> None:
    """Fill the prefill bar to its total, draw it and close it (a second call does nothing),
    before the answer prints: the answer then starts on a line of its own."""
    if not bar.disable and bar.total is not None and bar.n < bar.total:
        bar.n = bar.total
    if not bar.disable:
        bar.refresh()  # tqdm skips redraws within its interval: the last one may not show
    bar.close()


def grid(header: list[str], rows: dict[str, list[Any]], min_width: int = 14) -> str:
    """A plain-text table: one column per ``header`` entry, one line per ``rows`` key."""
    width = max(len(k) for k in rows) + 2
    cols = [
        max(min_width, len(h) + 2, *(len(str(cells[j])) + 2 for cells in rows.values()))
        for j, h in enumerate(header)
    ]
    lines = ["".ljust(width) + "".join(h.rjust(c) for h, c in zip(header, cols, strict=True))]
    for key, cells in rows.items():
        lines.append(
            key.ljust(width) + "".join(str(v).rjust(c) for v, c in zip(cells, cols, strict=True))
        )
    return "\n".join(lines)


def table(runs: list[Run]) -> str:
    keys = dict.fromkeys(key for r in runs for key in r.stats)  # a document run adds rows
    rows = {k: [cell(r.stats.get(k, "-")) for r in runs] for k in keys}
    return grid([r.label for r in runs], rows)


def cell(value: Any) -> Any:
    """A stat as a table cell: layer lists as ranges (``0-4,6-10``), by kind for a dict."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        return "; ".join(f"{k} {cell(v)}" for k, v in value.items()) or "-"
    if not isinstance(value, list):
        return value
    if not value:
        return "-"
    spans: list[list[int]] = []
    for i in value:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def side_by_side(runs: list[Run], width: int = 48) -> str:
    import textwrap

    wrapped = [textwrap.wrap(r.answer.strip(), width) or [""] for r in runs]
    height = max(len(w) for w in wrapped)
    lines = [" | ".join(r.label.ljust(width) for r in runs)]
    lines.append("-+-".join("-" * width for _ in runs))
    for i in range(height):
        lines.append(" | ".join((w[i] if i < len(w) else "").ljust(width) for w in wrapped))
    return "\n".join(lines)
