"""``velox-serve`` pins every conversation's system prompt and tool definitions.

A real server (the embedded model, TOVA at a small budget) holds a conversation of 10 turns
that overflow the budget many times, on the OpenAI route and on the Messages route: every cache
the server stores after a turn (the prompt cache the next turn starts from) holds the pinned
span's rows byte for byte as after the first turn. The server runs through a wrapper that
writes, for each stored cache, layer 0's rows at the pinned positions to a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_serve import Server
from test_serve_agents import anthropic_client, raw

from velox_mlx_lm.serve.pins import PinTable, common_prefix, system_span

pytestmark = [pytest.mark.model, pytest.mark.slow]

BUDGET = 160
REPLY = 4  # tokens per reply: the turns' prompts overflow the budget, the replies need not
SYSTEM = (
    "You are a careful coding agent. Rules: answer in one short sentence; the project's "
    "code name is BLUE HERON; never delete files; the test command is nox -s tests."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
RECORDING = """
import json, os, sys
import velox_mlx_lm.serve as serve  # first: it loads OpenBLAS before mlx is imported
import mlx.core as mx
import numpy as np
from velox_mlx_lm.serve.cache import VeloxPromptCache
from velox_mlx_lm.pins import velox_layers
out = os.environ["VELOX_PIN_RECORD"]
insert = VeloxPromptCache.insert_cache
def recorded(self, model, tokens, prompt_cache, *args, **kwargs):
    layer = next(iter(velox_layers(prompt_cache)), None)
    if layer is not None and layer.pinned_spans:
        (a, b), = layer.pinned_spans
        state = layer.policy_state
        pos = np.array(state.positions)[0, 0]
        keys = np.array(state.keys.astype(mx.float32))[0, 0]
        order = np.argsort(pos)
        rows = [keys[i].tolist() for i in order if a <= pos[i] < b]
        with open(out, "a") as f:
            f.write(json.dumps({"span": [a, b], "seen": len(tokens), "kept": len(pos),
                                "positions": sorted(int(p) for p in pos if a <= p < b),
                                "rows": rows}) + "\\n")
    return insert(self, model, tokens, prompt_cache, *args, **kwargs)
VeloxPromptCache.insert_cache = recorded
sys.exit(serve.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def server(embedded_model_path: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    record = tmp_path_factory.mktemp("pins") / "record.jsonl"
    os.environ["VELOX_PIN_RECORD"] = str(record)
    flags = ["--method", "tova", "--budget", str(BUDGET), "--max-tokens", str(REPLY)]
    srv = Server(*flags, "--max-pinned", "130", code=RECORDING)
    try:
        srv.wait_ready()
        yield srv, record
    finally:
        srv.stop()
        os.environ.pop("VELOX_PIN_RECORD", None)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_identical(records: list[dict[str, Any]], turns: int) -> None:
    assert len(records) >= turns, f"{len(records)} stored caches for {turns} turns"
    first = records[0]
    a, b = first["span"]
    assert b - a > 20  # the system prompt and tools, not a token or two
    assert records[-1]["seen"] > 4 * BUDGET  # the conversation overflowed the budget often
    for r in records:
        assert r["span"] == first["span"]
        assert r["kept"] <= BUDGET
        assert r["positions"] == list(range(a, b))
        np.testing.assert_array_equal(np.array(r["rows"]), np.array(first["rows"]))


PASSAGE = " ".join(f"Line {i}: build step {i} copies module {i} to the output." for i in range(4))


def test_openai_route_keeps_the_system_prompt_and_tools(server: Any) -> None:
    srv, record = server
    start = len(_records(record))
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(10):
        messages.append({"role": "user", "content": f"Turn {turn}. {PASSAGE} Summarise it."})
        status, _, body = raw(
            srv,
            "POST",
            "/v1/chat/completions",
            {"model": "default_model", "messages": messages, "tools": TOOLS, "max_tokens": REPLY},
        )
        assert status == 200, body
        assert body["usage"]["velox"]["pinned_tokens"] > 20
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    _check_identical(_records(record)[start:], 10)
    stats = raw(srv, "GET", "/v1/velox/stats")[2]
    assert stats["max_pinned"] == 130


def test_messages_route_keeps_the_system_prompt(server: Any) -> None:
    srv, record = server
    start = len(_records(record))
    client = anthropic_client(srv)
    messages: list[dict[str, Any]] = []
    for turn in range(10):
        messages.append({"role": "user", "content": f"Step {turn}. {PASSAGE} What changed?"})
        reply = client.messages.create(
            model="default_model", max_tokens=REPLY, system=SYSTEM, messages=messages
        )
        text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
        messages.append({"role": "assistant", "content": text})
    _check_identical(_records(record)[start:], 10)


def test_a_system_prompt_over_max_pinned_is_a_400(server: Any) -> None:
    srv, _ = server
    long_system = "Rule: be brief. " * 60
    status, _, body = raw(
        srv,
        "POST",
        "/v1/chat/completions",
        {
            "model": "default_model",
            "messages": [
                {"role": "system", "content": long_system},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 4,
        },
    )
    assert status == 400
    assert "--max-pinned 130" in body["error"]["message"]


# ------------------------------------------------------------------------------ units


class _Request:
    request_type = "chat"

    def __init__(self, messages: list[dict[str, Any]], tools: Any = None) -> None:
        self.messages, self.tools = messages, tools


def test_system_span_is_the_prefix_the_system_messages_render() -> None:
    def tokenize(request: _Request) -> list[int]:  # one token per character of a plain render
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in request.messages)
        text += f"<tools>{json.dumps(request.tools)}</>" if request.tools else ""
        return [ord(c) for c in text + "<assistant>"]

    system = {"role": "system", "content": "rules"}
    user = {"role": "user", "content": "hi"}
    prompt = tokenize(_Request([system, user]))
    assert system_span(_Request([system, user]), prompt, tokenize) == len("<system>rules</><")
    assert system_span(_Request([user]), tokenize(_Request([user])), tokenize) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_pin_table_hands_spans_over_once() -> None:
    table = PinTable()
    table.put([1, 2, 3], 2)
    assert table.pop([1, 2, 3]) == 2 and table.pop([1, 2, 3]) == 0
    for i in range(PinTable.LIMIT + 5):
        table.put([i], 1)
    assert table.pop([0]) == 0 and table.pop([PinTable.LIMIT + 4]) == 1
