"""``velox-serve`` for agents, on real servers with the embedded model: the API key on every
route, ``POST /v1/messages`` with the official ``anthropic`` client (against the OpenAI route
on the same conversation), the memory bound under many conversations, and conversations past
the model's context with ``--beyond-context`` (the context lowered to 64 tokens by a wrapper,
to keep the prompts short)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_serve import BUDGET, QUESTION, TOKENS, Server, passage

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "test-key-7f3a"
CONTEXT = 64
BOUND = 16_000_000  # about two requests' admission cost at budget 48
LOWERED_CONTEXT = f"""
import sys
import velox_mlx_lm.serve as serve
load = serve.VeloxModelProvider._load_velox
def lowered(self):
    load(self)
    self.context_length = {CONTEXT}
serve.VeloxModelProvider._load_velox = lowered
sys.exit(serve.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def servers(embedded_model_path: Any) -> Iterator[tuple[Server, Server]]:
    """(with an API key; with a small memory bound, a queue of 2 and --beyond-context)."""
    flags = ["--method", "tova", "--budget", str(BUDGET), "--max-tokens", str(TOKENS)]
    flags += ["--max-pinned", "0"]  # tools over half the budget of 48: pinning has its own tests
    keyed = Server(*flags, key=KEY)
    bounded_flags = [*flags, "--max-memory", str(BOUND), "--max-queue", "2", "--beyond-context"]
    bounded = Server(*bounded_flags, code=LOWERED_CONTEXT)
    try:
        keyed.wait_ready()
        bounded.wait_ready()
        yield keyed, bounded
    finally:
        keyed.stop()
        bounded.stop()


def anthropic_client(server: Server, key: str | None = None) -> Any:
    import anthropic

    return anthropic.Anthropic(
        base_url=server.url, api_key=key or server.key or "unused", max_retries=0
    )


def raw(
    server: Server, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    """(status, headers, parsed body) of one request, sending exactly ``headers``."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    data = None if body is None else json.dumps(body).encode()
    conn.request(
        method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    response = conn.getresponse()
    text = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), json.loads(text) if text else None


CHAT = [{"role": "user", "content": "hi"}]
# anthropic>=2 sends no temperature of its own; the body still takes Anthropic's field.
GREEDY = {"temperature": 0.0}


def test_api_key_on_every_route(servers: tuple[Server, Server]) -> None:
    import anthropic
    import openai

    keyed, _ = servers
    assert raw(keyed, "GET", "/health")[0] == 200  # open without a key
    openai_routes = [
        ("GET", "/v1/models", None),
        ("GET", "/v1/velox/stats", None),
        ("POST", "/v1/chat/completions", {"messages": CHAT}),
        ("POST", "/v1/completions", {"prompt": "hi"}),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        for method, path, body in openai_routes:
            status, _, error = raw(keyed, method, path, body, headers)
            assert status == 401, (path, headers)
            assert error["error"]["code"] == "invalid_api_key"
        request = {"max_tokens": 4, "messages": CHAT}
        status, _, error = raw(keyed, "POST", "/v1/messages", request, headers)
        assert status == 401 and error["type"] == "error"
        assert error["error"]["type"] == "authentication_error"
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert raw(keyed, "GET", "/v1/models", None, headers)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(keyed, "wrong").messages.create(
            model="velox-embedded", max_tokens=4, messages=CHAT
        )
    assert KEY not in keyed.tail()  # never logged


CONVERSATION = [
    {"role": "user", "content": f"{passage(60)}\n\nWhat is the passage about?"},
    {"role": "assistant", "content": "It is about plants and how they grow."},
    {"role": "user", "content": QUESTION},
]


def test_messages_equal_chat_completions(servers: tuple[Server, Server]) -> None:
    """System prompt, multi-turn, text blocks: the same greedy answer and prompt as the
    OpenAI route gives for the same conversation."""
    keyed, _ = servers
    system = "You answer in one sentence."
    chat = keyed.client().chat.completions.create(
        model="velox-embedded",
        messages=[{"role": "system", "content": system}, *CONVERSATION],
        max_tokens=TOKENS,
        temperature=0.0,
    )
    blocks = [{"type": "text", "text": CONVERSATION[-1]["content"]}]
    reply = anthropic_client(keyed).messages.create(
        model="velox-embedded",
        max_tokens=TOKENS,
        extra_body=GREEDY,
        system=[{"type": "text", "text": system}],
        messages=[*CONVERSATION[:-1], {"role": "user", "content": blocks}],
    )
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text"
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens > BUDGET
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    expected = "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    assert reply.stop_reason == expected
    velox = reply.usage.model_extra["velox"]
    assert velox["method"] == "tova" and velox["tokens_kept"] == BUDGET


def test_messages_streaming_equals_non_streaming(servers: tuple[Server, Server]) -> None:
    keyed, _ = servers
    client = anthropic_client(keyed)
    kwargs: dict[str, Any] = {
        "model": "velox-embedded",
        "max_tokens": TOKENS,
        "messages": CONVERSATION,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens

    body = {**kwargs, **GREEDY, "stream": True}
    del body["extra_body"]
    conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=600)
    conn.request("POST", "/v1/messages", json.dumps(body).encode(), {"x-api-key": KEY})
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    events = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    events = [e for e in events if e != "ping"]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    delta = json.loads(next(line for line in lines if '"message_delta"' in line)[6:])
    assert delta["usage"]["velox"]["tokens_kept"] == BUDGET


def test_messages_stop_sequences_and_max_tokens(servers: tuple[Server, Server]) -> None:
    keyed, _ = servers
    client = anthropic_client(keyed)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs: dict[str, Any] = {"model": "velox-embedded", "extra_body": GREEDY}
    text = client.messages.create(max_tokens=TOKENS, messages=messages, **kwargs)
    words = text.content[0].text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = client.messages.create(
        max_tokens=TOKENS, messages=messages, stop_sequences=[stop], **kwargs
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text.strip() == " ".join(words[:2])
    short = client.messages.create(max_tokens=2, messages=messages, **kwargs)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_messages_bad_requests_and_tools(servers: tuple[Server, Server]) -> None:
    keyed, _ = servers
    key = {"x-api-key": KEY}
    cases = [
        ({"messages": CHAT}, 400, "invalid_request_error"),  # no max_tokens
        ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
        ({"max_tokens": 4, "messages": CHAT, "temperature": "hot"}, 400, "invalid_request_error"),
        ({"max_tokens": 4, "messages": CHAT, "model": "claude-x"}, 404, "not_found_error"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "invalid_request_error",
        ),
    ]
    for body, status, kind in cases:
        got, _, error = raw(keyed, "POST", "/v1/messages", body, key)
        assert (got, error["type"], error["error"]["type"]) == (status, "error", kind), body
    assert "--beyond-context" in error["error"]["message"]
    tools = [
        {
            "name": "get_weather",
            "description": "The weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    client = anthropic_client(keyed)
    reply = client.messages.create(model="velox-embedded", max_tokens=8, messages=CHAT, tools=tools)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    # SmolLM2's template ignores tools: they are rendered into the system text instead.
    plain = client.messages.create(model="velox-embedded", max_tokens=1, messages=CHAT)
    schema = json.dumps({"name": "get_weather", "parameters": tools[0]["input_schema"]})
    assert reply.usage.input_tokens > plain.usage.input_tokens + len(schema) // 8
    counted = client.messages.count_tokens(model="velox-embedded", messages=CHAT, tools=tools)
    assert counted.input_tokens == reply.usage.input_tokens
    # the chat route renders the same fallback for the same tools
    functions = [{"type": "function", "function": {"name": "get_weather", **tools[0]}}]
    del functions[0]["function"]["input_schema"]
    functions[0]["function"]["parameters"] = tools[0]["input_schema"]
    chat = keyed.client().chat.completions.create(
        model="velox-embedded", messages=CHAT, tools=functions, max_tokens=1
    )
    assert chat.usage.prompt_tokens > plain.usage.input_tokens + len(schema) // 8
    assert raw(keyed, "POST", "/v1/chat/completions", {"messages": CHAT}, key)[0] == 200


def test_count_tokens_and_unknown_routes(servers: tuple[Server, Server]) -> None:
    """count_tokens renders the prompt /v1/messages renders (system, tool turns); unknown
    routes get a JSON 404 in their route family's error shape."""
    keyed, _ = servers
    client = anthropic_client(keyed)
    messages: list[Any] = [
        *CONVERSATION[:-1],
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "/"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]},
    ]
    kwargs: dict[str, Any] = {
        "model": "velox-embedded",
        "system": "Be brief.",
        "messages": messages,
    }
    counted = client.messages.count_tokens(**kwargs)
    reply = client.messages.create(max_tokens=1, **kwargs)
    assert counted.input_tokens == reply.usage.input_tokens > BUDGET
    shorter = client.messages.count_tokens(model="velox-embedded", messages=CONVERSATION[:1])
    assert 0 < shorter.input_tokens < counted.input_tokens
    key = {"x-api-key": KEY}
    status, headers, error = raw(keyed, "POST", "/v1/messages/nope", {}, key)
    assert status == 404 and headers["Content-type"] == "application/json"
    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
    for method in ("GET", "POST"):
        status, _, error = raw(keyed, method, "/v1/nope", {} if method == "POST" else None, key)
        assert status == 404 and error["error"]["code"] == "not_found", error
        assert "/v1/nope" in error["error"]["message"]


def test_thinking_blocks_in_history_are_dropped(servers: tuple[Server, Server]) -> None:
    keyed, _ = servers
    client = anthropic_client(keyed)
    answer = CONVERSATION[1]["content"]
    thinking = [
        {"type": "thinking", "thinking": "The user asks about plants.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "text", "text": answer},
    ]
    history = [CONVERSATION[0], {"role": "assistant", "content": thinking}, CONVERSATION[2]]
    reply = client.messages.create(
        model="velox-embedded", max_tokens=TOKENS, messages=history, extra_body=GREEDY
    )
    plain = client.messages.create(
        model="velox-embedded", max_tokens=TOKENS, messages=CONVERSATION, extra_body=GREEDY
    )
    assert reply.usage.input_tokens == plain.usage.input_tokens
    assert reply.content[0].text == plain.content[0].text


def test_prompt_too_long_has_anthropics_wording(servers: tuple[Server, Server]) -> None:
    import anthropic
    import openai

    keyed, _ = servers
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(keyed).messages.create(model="velox-embedded", max_tokens=4, messages=long)
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    assert re.match(r"prompt is too long: \d+ tokens > 8192 maximum", message), message
    with pytest.raises(openai.BadRequestError) as chat:
        keyed.client().chat.completions.create(model="velox-embedded", messages=long, max_tokens=4)
    assert chat.value.code == "context_length_exceeded"


def test_second_turn_reads_the_prompt_cache(servers: tuple[Server, Server]) -> None:
    keyed, _ = servers
    client = anthropic_client(keyed)
    turn = [{"role": "user", "content": f"{passage(45)}\n\nWhat is the passage about?"}]
    first = client.messages.create(
        model="velox-embedded", max_tokens=TOKENS, messages=turn, extra_body=GREEDY
    )
    usage = first.usage
    assert usage.cache_read_input_tokens == 0
    assert usage.cache_creation_input_tokens == usage.input_tokens
    turn += [
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "Why?"},
    ]
    with client.messages.stream(
        model="velox-embedded", max_tokens=TOKENS, messages=turn, extra_body=GREEDY
    ) as stream:
        second = stream.get_final_message().usage
    assert second.cache_read_input_tokens > usage.input_tokens // 2
    assert second.cache_read_input_tokens + second.cache_creation_input_tokens == (
        second.input_tokens
    )


def test_chat_route_refuses_ill_formed_messages(servers: tuple[Server, Server]) -> None:
    import anthropic
    import openai

    keyed, _ = servers
    client = keyed.client()
    bad: list[Any] = [
        ([{"role": "robot", "content": "hi"}], "role"),
        ([{"role": "user", "content": None}], "content"),
        ({"role": "user", "content": "hi"}, "messages"),
    ]
    for messages, field in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="velox-embedded", messages=messages)
        assert field in caught.value.body["message"], caught.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as big:
        client.chat.completions.create(model="velox-embedded", messages=CHAT, max_tokens=10**12)
    assert "max_tokens" in big.value.body["message"]  # type: ignore[index]
    assert "8192" in big.value.body["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as too_many:
        anthropic_client(keyed).messages.create(  # a timeout: the SDK's own check skipped
            model="velox-embedded", max_tokens=10**12, messages=CHAT, timeout=60
        )
    message = too_many.value.body["error"]["message"]  # type: ignore[index]
    assert "max_tokens" in message and "8192" in message


def test_one_log_line_per_request(servers: tuple[Server, Server]) -> None:
    """Every route logs one line (method, route, status, tokens, seconds), streaming chat and
    /v1/messages included; a client gone mid-stream is one line, not a traceback."""
    keyed, _ = servers
    start = len(Path(keyed.log.name).read_text())
    stream = keyed.client().chat.completions.create(
        model="velox-embedded", messages=CHAT, max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    anthropic_client(keyed).messages.create(model="velox-embedded", max_tokens=3, messages=CHAT)
    raw(keyed, "GET", "/v1/models", None, {"x-api-key": KEY})
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    body = json.dumps({"messages": story, "max_tokens": 200, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", keyed.port), timeout=300)
    head = f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    reader = sock.makefile("rb")
    while b"content_block_delta" not in reader.readline():
        pass
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reader.close()
    sock.close()  # a reset: the server's next write fails
    deadline = time.monotonic() + 120
    pattern = (
        r"request POST /v1/messages: client disconnected \((BrokenPipe|ConnectionReset)Error\)"
    )
    while not re.search(pattern, log := Path(keyed.log.name).read_text()[start:]):
        assert time.monotonic() < deadline, log
        time.sleep(0.5)
    assert re.search(pattern, log), log
    assert "Traceback" not in log
    line = r"request {} {}: status 200, prompt \d+ tokens \(\d+ from the prompt cache\), "
    line += r"{} generated, [\d.]+ s"
    assert re.search(line.format("POST", "/v1/chat/completions", r"[1-4]"), log), log
    assert re.search(line.format("POST", "/v1/messages", r"[1-3]"), log), log
    assert re.search(line.format("GET", "/v1/models", "0"), log), log


def converse(server: Server, i: int, outcomes: list[Any]) -> None:
    """Two turns of one conversation over raw HTTP; records each turn's outcome."""
    messages = [{"role": "user", "content": f"{passage(20 + 5 * i)}\n\n{QUESTION}"}]
    for _ in range(2):
        body = {"messages": messages, "max_tokens": 8, "temperature": 0.0}
        status, headers, reply = raw(server, "POST", "/v1/chat/completions", body)
        outcomes.append((status, headers.get("Retry-After"), reply))
        if status != 200:
            return
        answer = reply["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]


def test_memory_bound_holds_under_many_conversations(servers: tuple[Server, Server]) -> None:
    _, bounded = servers
    outcomes: list[Any] = []
    threads = [threading.Thread(target=converse, args=(bounded, i, outcomes)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) >= 8
    for status, retry_after, reply in outcomes:
        if status == 200:
            assert reply["usage"]["velox"]["tokens_kept"] <= BUDGET
        else:  # refused, never dropped: a 503 saying when to retry
            assert status == 503 and retry_after is not None, reply
            assert reply["error"]["code"] == "overloaded"
    assert sum(status == 200 for status, _, _ in outcomes) >= 2
    stats = bounded.stats()
    bound = stats["memory_bound"]
    assert bound["bound_bytes"] == BOUND
    assert 0 < bound["peak_used_bytes"] <= BOUND
    assert stats["prompt_cache"]["bytes"] <= BOUND
    assert bound["reserved_bytes"] == 0 and bound["running"] == 0
    assert bound["queue"] == {"waiting": 0, "max": 2}
    assert bound["admitted"] == sum(status == 200 for status, _, _ in outcomes)


def test_beyond_context_keeps_the_budget(servers: tuple[Server, Server]) -> None:
    """The context is lowered to 64 tokens: a 150-token prompt goes on past it, and the
    cache still keeps at most the budget."""
    _, bounded = servers
    prompt = f"{passage(110)}\n\n{QUESTION}"
    reply = bounded.client().chat.completions.create(
        model="velox-embedded",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0.0,
    )
    assert reply.usage.prompt_tokens > 2 * CONTEXT
    velox = reply.usage.model_extra["velox"]
    assert velox["tokens_seen"] > 2 * CONTEXT and velox["tokens_kept"] == BUDGET
    message = anthropic_client(bounded).messages.create(
        model="velox-embedded",
        max_tokens=TOKENS,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": prompt}],
    )
    assert message.content[0].text == reply.choices[0].message.content
