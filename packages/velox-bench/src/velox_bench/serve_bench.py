"""Load generator for ``velox-serve``: N concurrent conversations of growing length.

Each conversation is a thread that sends turns to ``/v1/chat/completions`` (streaming, greedy,
``stream_options.include_usage``) and appends the answer to its messages, so each turn's prompt
is the previous turn plus a new user message (the server's prompt cache serves the shared
prefix). Conversations start each turn together (a barrier), so that a turn's aggregate decode
throughput is the batch decoding at that turn's context, not decode stalled behind another
conversation's next, longer prefill (unsynchronised, a fast turn 0 of one method overlaps the
turn-1 prefills of the others and the per-turn ratio measures that scheduling instead; set
``synchronized=False`` for that load). A sampler thread polls ``GET /v1/velox/stats`` for memory
over time (``velox_bench.serve_run`` has the server, the streams and the run's scaffold).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from velox_bench.results import save_figure
from velox_bench.serve_run import (
    ServerProcess,
    passage_words,
    percentile,
    run_conversations,
    stream_chat,
)

TOKENS_PER_WORD = 1.3  # the passage's words per token with SmolLM2's tokenizer, roughly
QUESTION = "Summarise the last paragraph in one sentence."


@dataclass(frozen=True)
class LoadSpec:
    conversations: int = 4
    turns: int = 5
    start_tokens: int = 400  # the first turn's prompt, below the budget: no eviction yet
    end_tokens: int = 6000  # the last turn's prompt
    gen_tokens: int = 32
    poll_s: float = 0.5
    synchronized: bool = True  # every conversation starts turn t together (see the module doc)

    def turn_tokens(self) -> list[int]:
        """The prompt length each turn aims at (linear from start to end)."""
        if self.turns == 1:
            return [self.end_tokens]
        step = (self.end_tokens - self.start_tokens) / (self.turns - 1)
        return [round(self.start_tokens + i * step) for i in range(self.turns)]


def conversation(
    port: int,
    index: int,
    spec: LoadSpec,
    t0: float,
    out: list[dict[str, Any]],
    barrier: threading.Barrier | None = None,
) -> None:
    words = passage_words(index * 37)
    messages: list[dict[str, str]] = []
    sent = 0  # words sent so far
    try:
        for turn, target in enumerate(spec.turn_tokens()):
            have = round(sent * TOKENS_PER_WORD)
            n = max(8, round((target - have) / TOKENS_PER_WORD))
            chunk = " ".join(words[(sent + i) % len(words)] for i in range(n))
            sent += n
            messages.append({"role": "user", "content": f"{chunk}\n\n{QUESTION}"})
            if barrier is not None:
                barrier.wait()
            result = stream_chat(port, messages, spec.gen_tokens)
            if result["outcome"] != "completed":
                raise RuntimeError(f"turn {turn}: {result['status']} {result.get('detail')}")
            messages.append({"role": "assistant", "content": result["text"]})
            arrivals = result["arrivals"]
            usage = result["usage"] or {}
            velox = usage.get("velox", {})
            out.append(
                {
                    "conversation": index,
                    "turn": turn,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ),
                    "completion_tokens": usage.get("completion_tokens"),
                    "tokens_kept": velox.get("tokens_kept"),
                    "kv_bytes": velox.get("kv_bytes"),
                    "start_s": result["start"] - t0,
                    "first_token_s": (arrivals[0] - t0) if arrivals else None,
                    "end_s": (arrivals[-1] - t0) if arrivals else None,
                    "ttft_s": (arrivals[0] - result["start"]) if arrivals else None,
                    "itl_s": [b - a for a, b in itertools.pairwise(arrivals)],
                    "chunks": len(arrivals),
                }
            )
    except BaseException:
        if barrier is not None:  # the other conversations must not wait for this one forever
            barrier.abort()
        raise


def run_load(flags: list[str], spec: LoadSpec) -> dict[str, Any]:
    """Start a server with ``flags``, drive ``spec``'s conversations, stop it."""
    requests: list[dict[str, Any]] = []
    barrier = threading.Barrier(spec.conversations) if spec.synchronized else None
    server = ServerProcess(flags)

    def converse(index: int, t0: float) -> None:
        conversation(server.port, index, spec, t0, requests, barrier)

    run = run_conversations(server, spec.conversations, converse, spec.poll_s)
    return {
        "flags": flags,
        "wall_s": run["wall_s"],
        "requests": sorted(requests, key=lambda r: (r["turn"], r["conversation"])),
        "timeline": run["timeline"],
        "max_tokens_kept": run["final"]["max_tokens_kept_since_start"],
    }


def _decode_tokens_per_s(done: list[dict[str, Any]]) -> float | None:
    """Aggregate decode tokens/s of the requests ``done`` (those that streamed a chunk): the
    chunks after each first one, over the span from the first first-token to the last token."""
    decoded = sum(r["chunks"] - 1 for r in done)
    span = max(r["end_s"] for r in done) - min(r["first_token_s"] for r in done) if done else 0
    return decoded / span if span > 0 else None


def _turn_row(turn: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of :func:`summarize`'s ``per_turn``: ``rows`` are the requests of turn ``turn``."""
    done = [r for r in rows if r["chunks"]]
    itls = [x for r in done for x in r["itl_s"]]
    ttfts = [r["ttft_s"] for r in done]
    return {
        "turn": turn,
        "prompt_tokens_mean": round(sum(r["prompt_tokens"] or 0 for r in rows) / len(rows)),
        "decode_tokens_per_s": _decode_tokens_per_s(done),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "itl_p50_s": percentile(itls, 0.5),
        "itl_p95_s": percentile(itls, 0.95),
        "tokens_kept_max": max((r["tokens_kept"] or 0 for r in rows), default=0),
    }


def _peak(timeline: list[dict[str, Any]], key: str) -> Any:
    """The largest ``key`` over the stats samples of ``timeline`` (``None`` if none)."""
    return max((s[key] for s in timeline), default=None)


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Per turn: mean prompt tokens, aggregate decode tokens/s (chunks after the first over the
    span from the first first-token to the last token), TTFT and inter-token latency p50/p95;
    overall: generated tokens/s over the run and peak memory."""
    turns: dict[int, list[dict[str, Any]]] = {}
    for r in run["requests"]:
        turns.setdefault(r["turn"], []).append(r)
    generated = sum(r["chunks"] for r in run["requests"])
    timeline = run["timeline"]
    return {
        "per_turn": [_turn_row(turn, rows) for turn, rows in sorted(turns.items())],
        "generated_tokens_per_s": generated / run["wall_s"] if run["wall_s"] else None,
        "wall_s": run["wall_s"],
        "peak_rss_bytes": _peak(timeline, "rss_bytes"),
        "peak_mlx_active_bytes": _peak(timeline, "mlx_active_bytes"),
        "mlx_peak_bytes": _peak(timeline, "mlx_peak_bytes"),
        "max_tokens_kept": run["max_tokens_kept"],
    }


def goals(summaries: dict[str, dict[str, Any]], velox: str, full: str) -> dict[str, Any]:
    """Issue 14's goals, measured: aggregate decode throughput ratio at the longest and at the
    shortest turn, and whether Velox's memory stayed flat (peak RSS vs the first turn's)."""
    a, b = summaries[velox]["per_turn"], summaries[full]["per_turn"]

    def ratio(i: int) -> float | None:
        x, y = a[i]["decode_tokens_per_s"], b[i]["decode_tokens_per_s"]
        return x / y if x and y else None

    long_ratio, short_ratio = ratio(-1), ratio(0)
    return {
        "decode_ratio_longest_turn": long_ratio,
        "decode_ratio_longest_turn_goal": 1.5,
        "decode_ratio_longest_turn_met": bool(long_ratio and long_ratio >= 1.5),
        "decode_ratio_shortest_turn": short_ratio,
        "decode_ratio_shortest_turn_goal": 0.85,
        "decode_ratio_shortest_turn_met": bool(short_ratio and short_ratio >= 0.85),
    }


def _tokens_per_s_over_time(requests: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Generated tokens/s over time: the arrival of every token of every request, counted in
    bins of a 40th of the run (at least 1 s); (bin centres, rates), both empty if none arrived."""
    times = sorted(
        r["first_token_s"] + sum(r["itl_s"][:i])
        for r in requests
        if r["chunks"]
        for i in range(r["chunks"])
    )
    if not times:
        return [], []
    width = max(1.0, (times[-1] - times[0]) / 40)
    edges = [times[0] + i * width for i in range(int((times[-1] - times[0]) / width) + 2)]
    counts = [sum(1 for x in times if lo <= x < lo + width) / width for lo in edges[:-1]]
    return [lo + width / 2 for lo in edges[:-1]], counts


def plot_serve(data: dict[str, Any], paths: list[Path]) -> list[Path]:
    """Memory (RSS, MLX active) and aggregate decode throughput over time, both methods."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, run in data["runs"].items():
        tl = run["timeline"]
        t = [s["t_s"] for s in tl]
        axes[0].plot(t, [s["rss_bytes"] / 1e9 for s in tl], label=f"{label} RSS")
        axes[0].plot(t, [s["mlx_active_bytes"] / 1e9 for s in tl], "--", label=f"{label} MLX")
        axes[1].plot(t, [s["live_kv_bytes"] / 1e6 for s in tl], label=label)
        centres, rates = _tokens_per_s_over_time(run["requests"])
        if centres:
            axes[2].plot(centres, rates, label=label)
    axes[0].set(title="server memory", xlabel="time (s)", ylabel="GB")
    axes[1].set(title="KV bytes of live sequences", xlabel="time (s)", ylabel="MB")
    axes[2].set(title="generated tokens/s (all conversations)", xlabel="time (s)", ylabel="tok/s")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    spec = data["spec"]
    fig.suptitle(
        f"velox-serve: {spec['conversations']} conversations, {spec['turns']} turns, "
        f"prompts {spec['start_tokens']} -> {spec['end_tokens']} tokens"
    )
    fig.tight_layout()
    return save_figure(fig, paths)


def table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = ["method        turn  prompt  decode tok/s  TTFT p50/p95 s   ITL p50/p95 ms  kept"]
    for label, s in summaries.items():
        for t in s["per_turn"]:
            lines.append(
                f"{label:<13} {t['turn']:>4} {t['prompt_tokens_mean']:>7} "
                f"{_num(t['decode_tokens_per_s'], 1):>13} "
                f"{_num(t['ttft_p50_s'], 2):>7}/{_num(t['ttft_p95_s'], 2):<7} "
                f"{_num(_ms(t['itl_p50_s']), 0):>8}/{_num(_ms(t['itl_p95_s']), 0):<6} "
                f"{t['tokens_kept_max']:>5}"
            )
        lines.append(
            f"{label:<13} peak RSS {s['peak_rss_bytes'] / 1e9:.2f} GB, MLX peak "
            f"{s['mlx_peak_bytes'] / 1e9:.2f} GB, {s['generated_tokens_per_s']:.1f} tok/s overall"
        )
    return "\n".join(lines)


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spec_dict(spec: LoadSpec) -> dict[str, Any]:
    return {**asdict(spec), "turn_tokens": spec.turn_tokens()}
