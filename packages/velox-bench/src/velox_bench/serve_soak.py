"""Soak load for ``velox-serve`` (issue 33, point 5): agent-style conversations that grow past
the model's context, with RSS over time, lost requests and inter-token latency.

Each conversation is a thread: a fixed system prompt, then turns that each append a "tool
output" of ``turn_tokens`` tokens of real text and an instruction, stream the reply
(greedy, ``gen_tokens``) and append it, so every turn's prompt is the previous one plus the
reply plus the new turn (the server's prompt cache serves the shared prefix). A conversation
stops once its prompt has passed ``target_tokens``, or, for a server that must stay inside the
model's context, before the next turn would pass ``context``; and every conversation stops
starting turns at ``max_s`` (the run is bounded in time). The conversations are not
synchronised, as agents are not. A sampler polls ``GET /v1/velox/stats`` every ``poll_s``.

Every request is accounted for: ``completed`` (HTTP 200, the stream ended with ``[DONE]`` and
a usage chunk), ``refused`` (a 503 with ``Retry-After``: the memory bound said so) or
``lost`` (anything else: an error status, a broken stream, an exception).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any

from velox_bench.serve_run import (
    ServerProcess,
    passage_words,
    percentile,
    run_conversations,
    stream_chat,
)

SYSTEM = (
    "You are a coding agent. Each user turn holds a tool's output; answer with the next step "
    "in one short sentence."
)
INSTRUCTION = "Tool output above. What is the next step?"
TOKENS_PER_WORD = 1.3  # words per token of the embedded paragraph with SmolLM2's tokenizer

# ``python -c`` entry that runs velox-serve with the model's context lowered to sys.argv[1]
# (the smoke size: a short run that still goes past the context).
LOWERED_CONTEXT = """
import sys
import velox_mlx_lm.serve as serve
context = int(sys.argv.pop(1))
load = serve.VeloxModelProvider._load_velox
def lowered(self):
    load(self)
    self.context_length = context
serve.VeloxModelProvider._load_velox = lowered
sys.exit(serve.main(sys.argv[1:]))
"""


@dataclass(frozen=True)
class SoakSpec:
    conversations: int = 4
    turn_tokens: int = 1500  # tokens each turn adds (the tool output)
    target_tokens: int = 12_288  # a conversation stops once its prompt has passed this
    gen_tokens: int = 32
    context: int = 8192  # the model's context (the full cache stops before passing it)
    max_s: float = 1800.0  # no turn starts after this many seconds of a run
    warmup_turns: int = 2  # RSS is compared after every conversation has done these turns
    poll_s: float = 1.0


def soak_server(flags: list[str], lowered_context: int | None = None) -> ServerProcess:
    """``velox-serve`` with ``flags``; with ``lowered_context``, the model's context is lowered
    to it (for the smoke size)."""
    if lowered_context is None:
        return ServerProcess(flags)
    return ServerProcess(flags, entry=["-c", LOWERED_CONTEXT, str(lowered_context)])


def _turn_row(index: int, turn: int, result: dict[str, Any], t0: float) -> dict[str, Any]:
    usage = result.get("usage") or {}
    arrivals = result.get("arrivals") or []
    velox = usage.get("velox") or {}
    return {
        "conversation": index,
        "turn": turn,
        "outcome": result["outcome"],
        "status": result["status"],
        "detail": result.get("detail"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "tokens_kept": velox.get("tokens_kept"),
        "start_s": result["start"] - t0 if "start" in result else None,
        "end_s": (arrivals[-1] - t0) if arrivals else None,
        "ttft_s": (arrivals[0] - result["start"]) if arrivals else None,
        "itl_s": [b - a for a, b in itertools.pairwise(arrivals)],
        "chunks": len(arrivals),
    }


def converse(
    port: int, index: int, spec: SoakSpec, stay_in_context: bool, t0: float
) -> list[dict[str, Any]]:
    """One conversation's turns (rows), until its target, its context or the deadline."""
    words = passage_words(index * 53)
    per_turn = max(8, round(spec.turn_tokens / TOKENS_PER_WORD))
    messages = [{"role": "system", "content": SYSTEM}]
    rows: list[dict[str, Any]] = []
    prompt_tokens = 0
    for turn in itertools.count():
        if time.perf_counter() - t0 > spec.max_s or prompt_tokens > spec.target_tokens:
            break
        # The next prompt: this one, the reply, the new turn (with slack for the estimate).
        next_size = prompt_tokens + spec.gen_tokens + 1.25 * spec.turn_tokens + 64
        if stay_in_context and next_size > spec.context:
            break
        chunk = " ".join(words[(turn * per_turn + i) % len(words)] for i in range(per_turn))
        messages.append({"role": "user", "content": f"{chunk}\n\n{INSTRUCTION}"})
        result = stream_chat(port, messages, spec.gen_tokens, timeout=1800)
        rows.append(_turn_row(index, turn, result, t0))
        if result["outcome"] != "completed":
            break  # a refused or lost turn ends the conversation (it is counted, not retried)
        messages.append({"role": "assistant", "content": result["text"]})
        prompt_tokens = result["usage"].get("prompt_tokens") or prompt_tokens
    return rows


def run_soak(
    flags: list[str], spec: SoakSpec, stay_in_context: bool, lowered_context: int | None = None
) -> dict[str, Any]:
    """Start a server with ``flags``, drive ``spec``'s conversations, stop it."""
    server = soak_server(flags, lowered_context)
    per_conversation: list[list[dict[str, Any]]] = [[] for _ in range(spec.conversations)]

    def drive(index: int, t0: float) -> None:
        per_conversation[index] = converse(server.port, index, spec, stay_in_context, t0)

    run = run_conversations(server, spec.conversations, drive, spec.poll_s)
    return {
        "flags": flags,
        "wall_s": run["wall_s"],
        "requests": [row for rows in per_conversation for row in rows],
        "timeline": run["timeline"],
        "max_tokens_kept": run["final"]["max_tokens_kept_since_start"],
        "memory_bound": run["final"].get("memory_bound"),
    }


def warmup_end_s(run: dict[str, Any], warmup_turns: int) -> float | None:
    """When every conversation had finished its first ``warmup_turns`` turns (None if one
    never did)."""
    ends = []
    for _, rows in itertools.groupby(run["requests"], key=lambda r: r["conversation"]):
        done = [r for r in rows if r["turn"] < warmup_turns and r["end_s"] is not None]
        if len(done) < warmup_turns:
            return None
        ends.append(max(r["end_s"] for r in done))
    return max(ends) if ends else None


def rss_after_warmup(run: dict[str, Any], warmup_turns: int) -> dict[str, Any]:
    """The RSS after warm-up against the RSS during it, peak against peak.

    ``growth`` is the most RSS sampled after warm-up over the most sampled during it: both
    include the prefill activations, which come and go with every turn, so only memory that
    stays adds to it. The RSS at the first sample after warm-up (``rss_at_warmup_end_bytes``,
    the reference before issue 33's fix) depends on whether a prefill was running at that
    moment: once freed memory goes back to the OS, a sample between turns is far below the
    next prefill. ``growth_from_warmup_end_sample`` keeps that figure, and
    ``quarters_after_warmup`` has the most and least RSS per quarter of the samples after."""
    end = warmup_end_s(run, warmup_turns)
    timeline = run["timeline"]
    during = [s["rss_bytes"] for s in timeline if end is not None and s["t_s"] < end]
    after = [s["rss_bytes"] for s in timeline if end is not None and s["t_s"] >= end]
    if not during or not after:
        return {"warmup_end_s": end, "samples": len(after), "growth": None}
    peak = max(after)
    quarters = [after[i * len(after) // 4 : (i + 1) * len(after) // 4] for i in range(4)]
    return {
        "warmup_end_s": end,
        "samples": len(after),
        "rss_max_during_warmup_bytes": max(during),
        "rss_at_warmup_end_bytes": after[0],
        "rss_max_after_warmup_bytes": peak,
        "rss_min_after_warmup_bytes": min(after),
        "growth": peak / max(during) - 1,
        "growth_from_warmup_end_sample": peak / after[0] - 1,
        "quarters_after_warmup": [
            {"max_bytes": max(q), "min_bytes": min(q)} for q in quarters if q
        ],
    }


def summarize_soak(run: dict[str, Any], spec: SoakSpec) -> dict[str, Any]:
    """Outcomes, prompt sizes reached, ITL/TTFT percentiles (also over the turns whose prompt
    stayed within the context, to compare with the full cache) and RSS after warm-up."""
    rows = run["requests"]
    done = [r for r in rows if r["outcome"] == "completed"]
    return {
        **outcomes(rows, spec.conversations),
        "generated_tokens": sum(r["completion_tokens"] or 0 for r in done),
        **latencies(done, spec.context),
        "max_tokens_kept": run["max_tokens_kept"],
        "peak_rss_bytes": max((s["rss_bytes"] for s in run["timeline"]), default=None),
        "rss": rss_after_warmup(run, spec.warmup_turns),
        "wall_s": run["wall_s"],
    }


def outcomes(rows: list[dict[str, Any]], conversations: int) -> dict[str, Any]:
    """Requests by outcome, turns and the longest completed prompt per conversation."""
    reached = [0] * conversations
    for r in rows:
        if r["outcome"] == "completed":
            reached[r["conversation"]] = max(reached[r["conversation"]], r["prompt_tokens"])
    count = {k: sum(r["outcome"] == k for r in rows) for k in ("completed", "refused", "lost")}
    return {
        "requests": len(rows),
        **count,
        "turns_per_conversation": [
            sum(r["conversation"] == i for r in rows) for i in range(conversations)
        ],
        "max_prompt_tokens_per_conversation": reached,
    }


def latencies(done: list[dict[str, Any]], context: int) -> dict[str, Any]:
    """Inter-token latency p50/p99 over every turn and over the turns within ``context``;
    time to first token p50/p99."""
    itls = [x for r in done for x in r["itl_s"]]
    within = [x for r in done if (r["prompt_tokens"] or 0) <= context for x in r["itl_s"]]
    ttfts = [r["ttft_s"] for r in done]
    return {
        "itl_samples": len(itls),
        "itl_p50_s": percentile(itls, 0.5),
        "itl_p99_s": percentile(itls, 0.99),
        "itl_within_context_p50_s": percentile(within, 0.5),
        "itl_within_context_p99_s": percentile(within, 0.99),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "method        requests  ok refused lost  max prompt  ITL p50/p99 ms  "
        "(within ctx)   TTFT p50/p99 s  RSS growth"
    ]
    for label, s in summaries.items():
        growth = s["rss"]["growth"]
        lines.append(
            f"{label:<13} {s['requests']:>8} {s['completed']:>3} {s['refused']:>7} "
            f"{s['lost']:>4} {max(s['max_prompt_tokens_per_conversation']):>11} "
            f"{_ms(s['itl_p50_s'])}/{_ms(s['itl_p99_s'])}  "
            f"({_ms(s['itl_within_context_p50_s'])}/{_ms(s['itl_within_context_p99_s'])})  "
            f"{_s(s['ttft_p50_s'])}/{_s(s['ttft_p99_s'])}  "
            f"{'-' if growth is None else f'{100 * growth:+.1f}%'}"
        )
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def spec_dict(spec: SoakSpec) -> dict[str, Any]:
    return asdict(spec)
