"""A tool call written as a JSON object (fenced or bare) instead of the template's tool-call
tags is returned as a tool call when its name is one of the request's tools (serve/tools.py);
anything else stays text."""

from __future__ import annotations

import pytest

from velox_mlx_lm.serve.messages import parse_request
from velox_mlx_lm.serve.tools import fenced_tool_call, tool_names

NAMES = {"get_weather", "search"}


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '  ```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_a_json_object_naming_a_tool_is_a_call(text: str) -> None:
    assert fenced_tool_call(text, NAMES) == {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '```json\n{"name": "delete_all", "arguments": {}}\n```',  # not one of the tools
        '{"name": "get_weather", "arguments": "Paris"}',  # arguments not an object
        '{"name": "get_weather", "arguments": {}, "extra": 1}',  # more than a call
        'Here it is: {"name": "get_weather", "arguments": {}}',  # not the whole reply
        '```json\n{"name": "get_weather", "arguments": {\n```',  # cut short
        "```python\nprint(1)\n```",
        "[1, 2]",
    ],
)
def test_anything_else_stays_text(text: str) -> None:
    assert fenced_tool_call(text, NAMES) is None


def test_no_tools_means_no_call() -> None:
    text = '{"name": "get_weather", "arguments": {}}'
    assert fenced_tool_call(text, set()) is None


def test_tool_names_of_both_apis() -> None:
    openai_tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    assert tool_names(openai_tools) == {"search"}
    assert tool_names(None) == set() and tool_names([{"function": 3}]) == set()
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    }
    assert parse_request(body).tool_names == {"get_weather"}
