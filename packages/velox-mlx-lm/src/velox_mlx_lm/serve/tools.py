"""Tools for a chat template that does not render them (docs/serving.md, "Tools").

mlx-lm hands a request's ``tools`` to the chat template and only logs a warning when the
template ignores them (the embedded SmolLM2's does). ``velox-serve`` checks once, at load,
whether the template renders a dummy tool; if not, a request's tools are written into the
system text as JSON schemas, and its tool calls and tool results as text, so that the model
sees them rather than losing them silently.
"""

from __future__ import annotations

import json
import re
from typing import Any

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "velox_probe_tool_3141",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
TOOLS_HEADER = (
    "You can call the tools below. Each is given as a JSON object with its name, description "
    "and parameters (a JSON schema):"
)


def template_renders_tools(tokenizer: Any, template_args: dict[str, Any] | None = None) -> bool:
    """Whether the tokenizer's chat template renders ``tools``: a probe conversation rendered
    with and without a dummy tool differs (a template that fails on tools does not render
    them)."""
    if not getattr(tokenizer, "has_chat_template", False):
        return False
    probe = [{"role": "user", "content": "hi"}]
    kwargs = {**(template_args or {}), "tokenize": False, "add_generation_prompt": True}
    try:
        without = tokenizer.apply_chat_template(probe, **kwargs)
        with_tool = tokenizer.apply_chat_template(probe, tools=[PROBE_TOOL], **kwargs)
    except Exception:  # any template error means: tools are not rendered
        return False
    return bool(without != with_tool and "velox_probe_tool_3141" in str(with_tool))


def _tool_schema(tool: Any) -> str:
    function = tool.get("function", tool) if isinstance(tool, dict) else tool
    return json.dumps(function, ensure_ascii=False)


def tools_text(tools: list[Any]) -> str:
    """The system text that declares ``tools`` (OpenAI-style functions)."""
    return "\n".join([TOOLS_HEADER, *(_tool_schema(t) for t in tools)])


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call_text(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    name = function.get("name", "") if isinstance(function, dict) else ""
    arguments = function.get("arguments", {}) if isinstance(function, dict) else {}
    call_id = call.get("id") if isinstance(call, dict) else None
    where = f" (id {call_id})" if call_id else ""
    return f"Tool call {name}{where}: {_arguments(arguments)}"


def _content_text(content: Any) -> str:
    """A chat message's content as text (a string, or OpenAI's list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """One message with its tool call or tool result written as text."""
    role = message.get("role")
    if role == "tool":
        call_id = message.get("tool_call_id")
        where = f" (id {call_id})" if call_id else ""
        return {
            "role": "user",
            "content": f"Tool result{where}: {_content_text(message.get('content'))}",
        }
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        text = _content_text(message.get("content"))
        lines = [text] if text else []
        lines += [_call_text(call) for call in calls]
        rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
        return {**rest, "content": "\n\n".join(lines)}
    return message


def _merge_users(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent user turns (tool results, then the user's text) joined into one, for templates
    that require user and assistant turns to alternate."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if (
            previous is not None
            and previous.get("role") == message.get("role") == "user"
            and isinstance(previous.get("content"), str)
            and isinstance(message.get("content"), str)
        ):
            out[-1] = {**previous, "content": f"{previous['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out


def render_tools_as_text(
    messages: list[dict[str, Any]], tools: list[Any] | None
) -> list[dict[str, Any]]:
    """``messages`` for a template that does not render tools: ``tools`` declared in the system
    text (added to the first system message, or a new one first), tool calls and tool results
    as text. Messages without tools or tool turns come back unchanged."""
    has_tool_turns = any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )
    if not tools and not has_tool_turns:
        return messages
    out = _merge_users([_as_text(m) if isinstance(m, dict) else m for m in messages])
    if tools:
        declared = tools_text(tools)
        first = out[0] if out else None
        if isinstance(first, dict) and first.get("role") == "system":
            text = _content_text(first.get("content"))
            out[0] = {**first, "content": f"{text}\n\n{declared}" if text else declared}
        else:
            out.insert(0, {"role": "system", "content": declared})
    return out


_FENCE = re.compile(r"^```(?:json|tool_call|tool)?\s*\n?(.*?)\n?```$", re.DOTALL)


def tool_names(tools: Any) -> set[str]:
    """The names of a request's tools (OpenAI ``{"type": "function", "function": {...}}`` or
    Anthropic-converted ones)."""
    names = set()
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def fenced_tool_call(text: str, names: set[str]) -> dict[str, Any] | None:
    """A tool call the model wrote as a JSON object instead of its template's tool-call tags
    (Qwen2.5-Coder-1.5B answers a tool request with a ```json fenced ``{"name", "arguments"}``
    block): ``{"name", "arguments"}`` when the whole reply is one such object, fenced or bare,
    whose ``name`` is one of the request's tools and whose ``arguments`` is an object; else
    ``None`` (the reply stays text)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced is not None:
        body = fenced.group(1).strip()
    if not body.startswith("{"):
        return None
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or set(call) - {"name", "arguments", "parameters"}:
        return None
    name = call.get("name")
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": arguments}
