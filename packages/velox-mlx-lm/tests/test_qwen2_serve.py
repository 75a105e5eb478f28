"""``velox-generate``'s chat answer on Qwen2.5-Coder-1.5B, then a tool-call round trip through
``velox-serve`` with the official ``openai`` and ``anthropic`` clients (the command runs
first, so the two 7 GB processes never run at once).

The real model only (a random one makes no tool calls): under ``VELOX_MODELS=1``, which
``nox -s models`` sets (``pip install 'velox-mlx-lm[qwen]'``); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from test_serve import Server

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("VELOX_MODELS") != "1",
        reason="the real Qwen2.5-Coder-1.5B runs under VELOX_MODELS=1 (nox -s models)",
    ),
]

MODEL = "embedded:qwen2.5-coder-1.5b"
QUESTION = "What is the weather in Paris right now? Use the tool."
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name"}},
                "required": ["city"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in OPENAI_TOOLS
]
RESULT = '{"city": "Paris", "celsius": 21, "sky": "sunny"}'
# What an agent sends: without it the 1.5B model answers a tool result by calling the tool again
SYSTEM = (
    "You are a helpful assistant with tools. Call a tool when you need its data. When a tool "
    "result is given, do not call the tool again: answer the user from it in one sentence."
)


def test_generate_answers_with_code() -> None:
    """The issue's command: a chat answer with Python code, TOVA at budget 256."""
    argv = [
        sys.executable, "-m", "velox_mlx_lm.cli", "--model", MODEL, "--chat", "--prompt",
        "Write a Python function that reverses a string.", "--method", "tova", "--budget",
        "256", "--max-tokens", "64",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "def " in done.stdout and "return" in done.stdout


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # a budget above the ~300-token tool prompt: this checks the wiring, not eviction
    flags = ["--model", MODEL, "--method", "tova", "--budget", "1024", "--max-tokens", "64"]
    s = Server(*flags)
    try:
        s.wait_ready(timeout=600)
        yield s
    finally:
        s.stop()


def test_openai_tool_round_trip(server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, object]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0.0, timeout=600
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": RESULT})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, temperature=0.0, timeout=600
    )
    text = second.choices[0].message.content or ""
    print("openai answer:", text)
    assert "21" in text or "sunny" in text.lower()


def test_anthropic_tool_round_trip(server: Server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    messages: list[dict[str, object]] = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(
        model=MODEL, max_tokens=64, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0.0}, timeout=600,
    )  # fmt: skip
    assert first.stop_reason == "tool_use", first
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and "paris" in str(use.input["city"]).lower()
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        }
    )
    second = client.messages.create(
        model=MODEL, max_tokens=64, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS,
        extra_body={"temperature": 0.0}, timeout=600,
    )  # fmt: skip
    text = "".join(b.text for b in second.content if b.type == "text")
    print("anthropic answer:", text)
    assert second.stop_reason == "end_turn"
    assert "21" in text or "sunny" in text.lower()
