"""``POST /v1/messages``: Anthropic's Messages API on mlx-lm's batching and prompt cache.

A request is translated into the chat request mlx-lm's server already serves (system prompt
first, text blocks joined, ``tool_use``/``tool_result`` blocks as the chat template's tool
calls and tool messages, Anthropic tools as OpenAI-style functions), handed to the same
``ResponseGenerator`` as ``/v1/chat/completions`` (same batch, same prompt cache), and its
tokens are written back as an Anthropic message or its SSE events (``message_start``,
``content_block_start``, ``content_block_delta``, ``content_block_stop``, ``message_delta``,
``message_stop``). Errors use Anthropic's shape ``{"type": "error", "error": {...}}``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine
from mlx_lm.server import (
    CompletionRequest,
    GenerationArguments,
    LogitsProcessorArguments,
    ModelDescription,
    SamplingArguments,
)

from velox_mlx_lm.serve.errors import BadRequest
from velox_mlx_lm.serve.tools import fenced_tool_call, tool_names

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ROLES = ("user", "assistant")
# Assistant blocks a client sends back from an earlier turn; this route drops them from the
# prompt (its replies have no thinking blocks).
THINKING_BLOCKS = ("thinking", "redacted_thinking")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass
class MessagesRequest:
    """A validated ``/v1/messages`` body, its messages in chat-template form."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # the tools' names, kept when the tools go into the system text (serve/tools.py)
    tool_names: set[str] = field(default_factory=set)

    def completion_request(self) -> CompletionRequest:
        return CompletionRequest("chat", "", self.messages, self.tools, None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_blocks(blocks: Any, where: str) -> str:
    """The text of a string or a list of ``{"type": "text", "text": ...}`` blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise BadRequest(f"{where}[{i}] must be a text block {{'type': 'text', 'text': ...}}")
        if not isinstance(block.get("text"), str):
            raise BadRequest(f"{where}[{i}].text must be a string")
        parts.append(block["text"])
    return "\n\n".join(parts) if len(parts) > 1 else "".join(parts)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise BadRequest(f"{where} (tool_use) needs a string name and an object input")
    call_id = block.get("id") if isinstance(block.get("id"), str) else f"toolu_{uuid.uuid4().hex}"
    function: dict[str, Any] = {"name": block["name"], "arguments": block.get("input", {})}
    return {"id": call_id, "type": "function", "function": function}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    text = _text_blocks(content, f"{where}.content")
    message: dict[str, Any] = {"role": "tool", "content": text}
    if isinstance(block.get("tool_use_id"), str):
        message["tool_call_id"] = block["tool_use_id"]
    return message


def _blocks(
    role: str, content: list[Any], where: str
) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """A turn's content blocks sorted into (texts, tool calls, tool results)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_blocks([block], f"{where}.content"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in THINKING_BLOCKS and role == "assistant":
            continue  # earlier reasoning: accepted, left out of the prompt
        else:
            raise BadRequest(
                f"{at}: content blocks of type {kind!r} are not supported here (text; "
                f"tool_use, thinking and redacted_thinking in assistant turns; tool_result in "
                f"user turns)"
            )
    return texts, calls, results


def convert_message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages (a user turn carrying tool results
    becomes tool messages, then the user's text if any)."""
    if not isinstance(message, dict):
        raise BadRequest(f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be 'user' or 'assistant', got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks")
    texts, calls, results = _blocks(str(role), content, where)
    out: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def convert_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools (``name``, ``description``, ``input_schema``) as the OpenAI-style
    functions chat templates expect."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] must be an object with a string name")
        schema = tool.get("input_schema", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{i}].input_schema must be an object (a JSON schema)")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 1):
        raise BadRequest("temperature must be a number in [0, 1]")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise BadRequest("top_p must be a number in (0, 1]")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise BadRequest("top_k must be an integer >= 0")
    stop = body.get("stop_sequences", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop_sequences must be a list of non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "stop_sequences": stop,
        "stream": stream,
    }


def parse_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """Validate a ``/v1/messages`` body; raises :class:`BadRequest` (400) naming the field.
    ``count_only``: a ``/v1/messages/count_tokens`` body, which has no ``max_tokens``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise BadRequest("model must be a string")
    max_tokens: Any = 1 if count_only else body.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise BadRequest("max_tokens is required: an integer >= 1")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    for i, message in enumerate(raw):
        messages += convert_message(message, f"messages[{i}]")
    return MessagesRequest(
        model=model,
        max_tokens=max_tokens,
        messages=messages,
        tools=(tools := convert_tools(body.get("tools"))),
        tool_names=tool_names(tools),
        **_sampling(body),
    )


def generation_arguments(request: MessagesRequest, cli_args: Any) -> GenerationArguments:
    """mlx-lm's generation arguments for a request, the server's flags as defaults."""

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return GenerationArguments(
        model=ModelDescription(model="default_model", draft="default_model", adapter=None),  # type: ignore[arg-type]
        sampling=SamplingArguments(
            temperature=pick(request.temperature, cli_args.temp),
            top_p=pick(request.top_p, cli_args.top_p),
            top_k=pick(request.top_k, cli_args.top_k),
            min_p=cli_args.min_p,
            xtc_probability=0.0,
            xtc_threshold=0.1,
        ),
        logits=LogitsProcessorArguments(
            logit_bias=None,
            repetition_penalty=0.0,
            repetition_context_size=20,
            presence_penalty=0.0,
            presence_context_size=20,
            frequency_penalty=0.0,
            frequency_context_size=20,
        ),
        stop_words=token_stop_words(request.stop_sequences),
        max_tokens=request.max_tokens,
        num_draft_tokens=cli_args.num_draft_tokens,
        logprobs=False,
        top_logprobs=-1,
        seed=None,
        chat_template_kwargs=None,
    )


def token_stop_words(stop_sequences: list[str]) -> list[str]:
    """mlx-lm matches stop words as token sequences, and ``"Paris"`` alone tokenizes apart
    from the ``" Paris"`` a sentence generates: match both spellings."""
    words = list(stop_sequences)
    words += [f" {s}" for s in stop_sequences if not s[:1].isspace() and f" {s}" not in words]
    return words


def stop_reason(
    finish_reason: str | None,
    tokens: list[int],
    tokenizer: Any,
    stop_sequences: list[str],
) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for mlx-lm's finish reason: ``length`` is
    ``max_tokens``; a ``stop`` ends the turn unless the tokens end with a stop sequence."""
    if finish_reason == "length":
        return "max_tokens", None
    if tokens and stop_sequences and tokens[-1] not in set(tokenizer.eos_token_ids):
        text = tokenizer.decode(tokens)
        for sequence in stop_sequences:
            if text.endswith(sequence) or text.rstrip().endswith(sequence.rstrip()):
                return "stop_sequence", sequence
        for sequence in stop_sequences:
            if sequence in text[-(len(sequence) + 16) :]:
                return "stop_sequence", sequence
    return "end_turn", None


@dataclass
class Generated:
    """What a request generated, collected as the tokens arrive."""

    text: str = ""
    tool_texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cut: bool = False  # ended here at a stop sequence the token matcher missed


def _segments(sm_state: Any, gen: Any) -> tuple[Any, list[tuple[str, str]]]:
    """mlx-lm's text state machine over one generated piece (stop text and control
    sequences stripped), as its chat handler runs it."""
    if gen.finish_reason == "stop":
        sm_state, current = TextStateMachine.discard(sm_state)
        return sm_state, [(current, "")]
    sm_state, segments = TextStateMachine.split(sm_state, gen.text)
    if gen.finish_reason == "length":
        sm_state, flushed, current = TextStateMachine.flush(sm_state)
        segments.append((current, flushed))
    return sm_state, segments


class MessagesWriter:
    """Writes one request's reply: a JSON message, or Anthropic's SSE events as text arrives."""

    def __init__(self, handler: Any, request: MessagesRequest, prompt_tokens: int) -> None:
        self.handler = handler
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # prompt tokens the prompt cache gave (set once generating)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = 0  # content blocks opened so far
        self.text_open = False

    def event(self, kind: str, data: dict[str, Any]) -> None:
        out = self.handler.wfile
        out.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())
        out.flush()

    def message(self, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    def usage(self, output_tokens: int) -> dict[str, Any]:
        """``input_tokens`` is the whole prompt, as on the chat route; of it,
        ``cache_read_input_tokens`` came from the prompt cache and
        ``cache_creation_input_tokens`` were processed now (and are cached after)."""
        cached = min(max(self.cached_tokens, 0), self.prompt_tokens)
        return {
            "input_tokens": self.prompt_tokens,
            "output_tokens": output_tokens,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": self.prompt_tokens - cached,
        }

    def start(self) -> None:
        if self.request.stream:
            self.handler._set_stream_headers(200)
            self.handler.end_headers()
            self.event("message_start", {"message": self.message([], self.usage(0))})

    def ping(self, *_: Any) -> None:
        if self.request.stream:
            self.event("ping", {})

    def text(self, piece: str) -> None:
        if not self.request.stream or not piece:
            return
        if not self.text_open:
            block = {"type": "text", "text": ""}
            self.event("content_block_start", {"index": self.blocks, "content_block": block})
            self.text_open = True
        delta = {"type": "text_delta", "text": piece}
        self.event("content_block_delta", {"index": self.blocks, "delta": delta})

    def _close_text(self) -> None:
        if self.text_open:
            self.event("content_block_stop", {"index": self.blocks})
            self.blocks += 1
            self.text_open = False

    def finish(
        self, generated: Generated, tool_uses: list[dict[str, Any]], velox: dict[str, Any] | None
    ) -> None:
        reason, sequence = stop_reason(
            generated.finish_reason,
            generated.tokens,
            self.handler.provider.tokenizer,
            self.request.stop_sequences,
        )
        if tool_uses and reason == "end_turn":
            reason = "tool_use"
        usage = self.usage(len(generated.tokens))
        if velox is not None:
            usage["velox"] = velox
        if self.request.stream:
            self._stream_end(generated, tool_uses, reason, sequence, usage)
            return
        content: list[dict[str, Any]] = []
        if generated.text or not tool_uses:
            content.append({"type": "text", "text": generated.text})
        content += tool_uses
        body = self.message(content, usage)
        body.update(stop_reason=reason, stop_sequence=sequence)
        data = json.dumps(body).encode()
        self.handler._set_completion_headers(200)
        self.handler.send_header("Content-Length", str(len(data)))
        self.handler.end_headers()
        self.handler.wfile.write(data)
        self.handler.wfile.flush()

    def _stream_end(
        self,
        generated: Generated,
        tool_uses: list[dict[str, Any]],
        reason: str,
        sequence: str | None,
        usage: dict[str, Any],
    ) -> None:
        if not self.blocks and not self.text_open and not tool_uses:
            self.text_open = True  # an empty reply still has its (empty) text block
            empty = {"type": "text", "text": ""}
            self.event("content_block_start", {"index": 0, "content_block": empty})
        self._close_text()
        for tool in tool_uses:
            block = {**tool, "input": {}}
            self.event("content_block_start", {"index": self.blocks, "content_block": block})
            part = {"type": "input_json_delta", "partial_json": json.dumps(tool["input"])}
            self.event("content_block_delta", {"index": self.blocks, "delta": part})
            self.event("content_block_stop", {"index": self.blocks})
            self.blocks += 1
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        self.event("message_delta", {"delta": delta, "usage": usage})
        self.event("message_stop", {})


def tool_uses(ctx: Any, tool_texts: list[str], tools: Any) -> list[dict[str, Any]]:
    """The tool calls the model's tool parser finds, as Anthropic ``tool_use`` blocks."""
    out = []
    for text in tool_texts:
        try:
            parsed = ctx.tool_parser(text, tools)
        except (ValueError, TypeError, json.JSONDecodeError):
            continue  # a call cut short by max_tokens
        for call in parsed if isinstance(parsed, list) else [parsed]:
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = {"arguments": arguments}
            out.append(_tool_use(call.get("name", ""), arguments, call.get("id")))
    return out


def _tool_use(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """An Anthropic ``tool_use`` block (``input`` an object: a non-object is wrapped)."""
    return {
        "type": "tool_use",
        "id": call_id or f"toolu_{uuid.uuid4().hex}",
        "name": name,
        "input": arguments if isinstance(arguments, dict) else {"value": arguments},
    }


def collect(ctx: Any, responses: Any, writer: MessagesWriter) -> Generated:
    """Run the request's token stream through the text state machine, streaming its text."""
    generated = Generated()
    sm_state = ctx.text_sm.make_state(ctx.initial_state)
    previous = ctx.initial_state
    tool_text = ""
    raw = ""
    stops = writer.request.stop_sequences
    for gen in responses:
        raw += gen.text
        sm_state, segments = _segments(sm_state, gen)
        for current, piece in segments:
            if current == "tool":
                tool_text += piece
            elif current == "normal":
                if previous == "tool":
                    generated.tool_texts.append(tool_text)
                    tool_text = ""
                generated.text += piece
                writer.text(piece)
            previous = current  # reasoning text is not returned (no thinking blocks)
        generated.tokens.append(gen.token)
        if gen.finish_reason is not None:
            generated.finish_reason = gen.finish_reason
        elif any(s in raw for s in stops):  # a stop sequence inside a token: end here
            generated.finish_reason, generated.cut = "stop", True
            ctx.stop()
            break
    if previous == "tool" and tool_text:
        generated.tool_texts.append(tool_text)
    return generated


def serve_messages(handler: Any, request: MessagesRequest, prompt_tokens: int) -> None:
    """Generate ``request`` on the handler's response generator and write the reply."""
    writer = MessagesWriter(handler, request, prompt_tokens)
    args = generation_arguments(request, handler.response_generator.cli_args)
    try:
        ctx, responses = handler.response_generator.generate(
            request.completion_request(), args, progress_callback=writer.ping
        )
    except (BadRequest, ConnectionError):  # shutting down (503), or the client left
        raise
    except Exception as exc:
        raise BadRequest(f"generation failed: {exc}", 500, "api_error") from exc
    writer.cached_tokens = ctx.prompt_cache_count
    try:
        writer.start()
        generated = collect(ctx, responses, writer)
        uses = tool_uses(ctx, generated.tool_texts, request.tools) if ctx.has_tool_calling else []
        if not uses and not request.stream:  # a call written as a JSON object (serve/tools.py)
            call = fenced_tool_call(generated.text, request.tool_names)
            if call is not None:
                generated.text = ""
                uses = [_tool_use(call["name"], call["arguments"])]
        # A sequence cut short here is removed, not finished: it has no final stats.
        writer.finish(generated, uses, None if generated.cut else handler._velox_usage())
    finally:
        ctx.stop()  # a client gone mid-stream frees its sequence at the next step
