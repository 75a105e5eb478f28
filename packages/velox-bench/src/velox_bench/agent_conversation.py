"""A coding agent's conversation replayed through ``velox-serve`` past the model's context.

    python -m velox_bench.agent_conversation [--tokens 18000] [--configs NAME,...] [--quick]

The conversation is what a coding agent sends (issue 49, point 6): a system prompt holding the
project's rules, three facts and a tool definition; then turns that hand the model long tool
outputs of real code (:mod:`velox_bench.quality.code_text`; the first one carries one more
fact, a comment at its top) and ask for a one-line summary; every few turns a question whose
answer sits in the system prompt or in that first output. It goes through the official
``anthropic`` client on ``POST /v1/messages``, the whole conversation each turn (as agents
send it; the server's prompt cache reuses the stored prefix), until the conversation holds
``--tokens`` tokens.

Each configuration is one server: the full cache (it stops where the conversation no longer
fits the model's context, which it cannot go past), and bounded caches with
``--beyond-context``, their pins, positions and budget as its flags say. Per turn the result
keeps the tokens the server saw, whether the reply is degenerate (only whitespace, or one short
fragment repeated) and, for a question, whether the reply holds the answer. The summary table
gives, per configuration: the turns, the tokens reached, degenerate replies, and the share of
system-prompt and early-output questions answered (also within the turns the full cache
reached). Results: ``benchmarks/results/agent_conversation_<model>.json``, rewritten after each
configuration; a run of some configurations keeps the others' results for the same model and
``--tokens``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from velox_bench.quality.code_text import code_text
from velox_bench.results import results_dir
from velox_bench.serve_run import ServerProcess

MODEL = "embedded:smollm2-135m"
SYSTEM = (
    "You are a careful coding agent working in the user's repository. Rules: answer in one "
    "short sentence; never delete files; ask before running commands. Project facts: the "
    "project's code name is HERON. The test command is nox. The release branch is stable-7."
)
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository and return its text.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "the file's path"}},
            "required": ["path"],
        },
    }
]
EARLY_FACT = "# NOTE: the deploy key of this module is KESTREL.\n"
# (question, answer the reply must hold (case-insensitive), where the answer sits)
QUESTIONS = [
    ("What is the project's code name? Answer with the name only.", "heron", "system"),
    ("Which command runs the tests? Answer with the command only.", "nox", "system"),
    ("What is the release branch? Answer with the branch name only.", "stable-7", "system"),
    ("What deploy key was noted at the top of the first file? Answer with it only.", "kestrel",
     "early"),
]  # fmt: skip
CONFIGS = {
    "full": ["--method", "full"],
    "tova-pinned-compact": [
        *("--method", "tova", "--budget", "512", "--beyond-context", "--positions", "compact"),
    ],
    "tova-pinned-absolute": [
        *("--method", "tova", "--budget", "512", "--beyond-context", "--positions", "absolute"),
    ],
    # the recommended tier (4 bits, docs/quantized.md) at the bytes of 512 float32 rows: 384
    # rows (room for the 154 pinned tokens under the default --max-pinned, half the budget)
    # and a tier of 509 rows in the other 128 rows' bytes (TierSpec.max_nbytes)
    "tova-pinned-compact-tier4": [
        *("--method", "tova", "--budget", "384", "--demote-bits", "4", "--demote-budget", "509"),
        *("--beyond-context", "--positions", "compact"),
    ],
}
ASK_EVERY = 3  # a question after every third tool output


@dataclass(frozen=True)
class Turn:
    """One request of the conversation: its user text and, for a question, its answer."""

    text: str
    answer: str | None = None
    where: str | None = None


def tool_outputs(chunk_chars: int) -> list[str]:
    """The code handed over as tool outputs, ``chunk_chars`` characters each (the first one
    starts with :data:`EARLY_FACT`), cycling through the pinned sources."""
    code = code_text()
    chunks = [code[i : i + chunk_chars] for i in range(0, len(code), chunk_chars)]
    chunks[0] = EARLY_FACT + chunks[0]
    return chunks


def script(n_turns: int, chunk_chars: int) -> list[Turn]:
    """The user turns: tool outputs to summarise, a question after every :data:`ASK_EVERY`."""
    outputs = tool_outputs(chunk_chars)
    turns: list[Turn] = []
    asked = 0
    for i in range(n_turns):
        body = outputs[i % len(outputs)]
        turns.append(Turn(f"Output of read_file (part {i + 1}):\n```python\n{body}\n```\n"
                          "Summarise it in one sentence."))  # fmt: skip
        if (i + 1) % ASK_EVERY == 0:
            question, answer, where = QUESTIONS[asked % len(QUESTIONS)]
            turns.append(Turn(question, answer, where))
            asked += 1
    return turns


def degenerate(text: str) -> bool:
    """Whether a reply is only whitespace, or one short fragment repeated (at least three
    times, covering most of the reply)."""
    stripped = text.strip()
    if not stripped:
        return True
    words = re.findall(r"\S+", stripped)
    if len(words) >= 6 and len(set(words)) <= max(2, len(words) // 6):
        return True
    for size in range(1, 16):
        fragment = stripped[:size]
        if len(stripped) >= 3 * size and stripped.count(fragment) * size >= 0.8 * len(stripped):
            return True
    return False


def run_config(
    name: str, flags: Sequence[str], turns: list[Turn], max_tokens: int, model: str
) -> dict[str, Any]:
    """One server with ``flags``: the conversation until it ends or the server refuses a
    turn (the full cache past its context); every turn's outcome."""
    import anthropic
    from tqdm import tqdm  # type: ignore[import-untyped]

    server = ServerProcess(["--model", model, *flags, "--max-tokens", str(max_tokens)])
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0,
            timeout=3600,
        )  # fmt: skip
        messages: list[Any] = []
        tools: Any = TOOLS
        for turn in tqdm(turns, desc=name, unit="turn"):
            messages.append({"role": "user", "content": turn.text})
            began = time.perf_counter()
            try:
                reply = client.messages.create(
                    model=model,
                    max_tokens=max_tokens, system=SYSTEM, tools=tools, messages=messages,
                    extra_body={"temperature": 0.0},
                )  # fmt: skip
            except anthropic.BadRequestError as exc:  # past what the server takes
                rows.append({"stopped": str(exc)[:200]})
                break
            text = "".join(b.text for b in reply.content if b.type == "text")
            velox = (reply.usage.model_extra or {}).get("velox") or {}
            row: dict[str, Any] = {
                "tokens_seen": velox.get("tokens_seen", reply.usage.input_tokens),
                "tokens_kept": velox.get("tokens_kept"),
                "pinned_tokens": velox.get("pinned_tokens"),
                "seconds": round(time.perf_counter() - began, 2),
                "degenerate": degenerate(text),
                "reply": text[:200],
            }
            if turn.answer is not None:
                row.update(where=turn.where, correct=turn.answer in text.lower())
            rows.append(row)
            messages.append({"role": "assistant", "content": text or "(no reply)"})
    finally:
        server.stop()
    return {"name": name, "flags": list(flags), "turns": rows}


def _share(rows: list[dict[str, Any]]) -> float | None:
    """Share of ``rows`` (questions) answered, or ``None`` without any."""
    return round(sum(r["correct"] for r in rows) / len(rows), 3) if rows else None


def _config_summary(config: dict[str, Any], reach: int) -> dict[str, Any]:
    rows = [r for r in config["turns"] if "tokens_seen" in r]
    asked = [r for r in rows if "correct" in r]
    system = [r for r in asked if r["where"] == "system"]
    return {
        "turns": len(rows),
        "tokens_reached": max((r["tokens_seen"] for r in rows), default=0),
        "degenerate": sum(r["degenerate"] for r in rows),
        "system_answered": _share(system),
        "early_answered": _share([r for r in asked if r["where"] == "early"]),
        "system_answered_within_full": _share([r for r in system if r["tokens_seen"] <= reach]),
        "stopped": any("stopped" in r for r in config["turns"]),
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: turns, tokens reached, degenerate replies, questions answered (all,
    and within the tokens the full cache reached)."""
    full = next((c for c in result["configs"] if c["name"] == "full"), None)
    seen = [r.get("tokens_seen", 0) for r in full["turns"]] if full else []
    reach = max(seen, default=0)
    return {c["name"]: _config_summary(c, reach) for c in result["configs"]}


def table(result: dict[str, Any]) -> str:
    head = ("config", "turns", "tokens", "degenerate", "system", "early", "system<=full")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, s in result["summary"].items():
        cells = (
            name, s["turns"], s["tokens_reached"], s["degenerate"], s["system_answered"],
            s["early_answered"], s["system_answered_within_full"],
        )  # fmt: skip
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(f"| {line} |" for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velox_bench.agent_conversation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--tokens", type=int, default=18_000, help="conversation length")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--chunk-chars", type=int, default=3000, help="characters per output")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per reply")
    parser.add_argument("--quick", action="store_true", help="a few short turns (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="default: the results folder")
    args = parser.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {sorted(CONFIGS)}")
    chunk = 600 if args.quick else args.chunk_chars
    per_turn = chunk // 3  # about 3 characters per code token
    n_turns = 4 if args.quick else max(1, args.tokens // (per_turn + args.max_tokens + 20))
    turns = script(n_turns, chunk)
    max_tokens = 4 if args.quick else args.max_tokens
    name = args.model.removeprefix("embedded:")
    out = args.out or results_dir() / f"agent_conversation_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": args.model, "tokens": args.tokens, "configs": []}
    if out.is_file():  # a run of other configurations on the same conversation is kept
        old = json.loads(out.read_text())
        if (old.get("model"), old.get("tokens")) == (args.model, args.tokens):
            result["configs"] = [c for c in old["configs"] if c["name"] not in names]
    for config in names:  # the file is rewritten after each configuration
        result["configs"].append(run_config(config, CONFIGS[config], turns, max_tokens, args.model))
        result["summary"] = summary(result)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
