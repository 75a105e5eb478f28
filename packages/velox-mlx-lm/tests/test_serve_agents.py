"""``velox-serve`` for agents, on real servers with the embedded model: the API key on every
route, ``POST /v1/messages`` with the official ``anthropic`` client (against the OpenAI route
on the same conversation), the memory bound under many conversations, and conversations past
the model's context with ``--beyond-context`` (the context lowered to 64 tokens by a wrapper,
to keep the prompts short)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
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
    reply = anthropic_client(keyed).messages.create(
        model="velox-embedded", max_tokens=8, messages=CHAT, tools=tools
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")  # the template ignores tools
    assert raw(keyed, "POST", "/v1/chat/completions", {"messages": CHAT}, key)[0] == 200


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
