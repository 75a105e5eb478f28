"""``velox-serve`` on SIGTERM: it stops taking connections, refuses new requests on open ones
with 503, lets the streams in flight finish (``--drain-timeout``), and exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_serve import BUDGET, Server

pytestmark = [pytest.mark.model, pytest.mark.slow]

# SmolLM2's special tokens (<|endoftext|>, <|im_start|>, <|im_end|>) pushed away, so that the
# stream runs its whole max_tokens and is still in flight when SIGTERM comes.
NO_EOS = {"0": -100.0, "1": -100.0, "2": -100.0}
LONG = 160


def stream(port: int, out: dict[str, Any]) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": NO_EOS,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps(body).encode())
    response = conn.getresponse()
    out["status"] = response.status
    lines = [line for line in iter(response.readline, b"") if line.startswith(b"data: ")]
    out["done"] = bool(lines) and lines[-1].strip() == b"data: [DONE]"
    usage = [json.loads(line[6:]) for line in lines[:-1]]
    out["usage"] = next((c["usage"] for c in reversed(usage) if c.get("usage")), None)
    conn.close()


@pytest.fixture
def start(embedded_model_path: Any) -> Iterator[Callable[..., Server]]:
    """Starts a TOVA server with the given flags and waits until it is ready; stops it after
    the test (a no-op once it has exited)."""
    servers: list[Server] = []

    def started(*flags: str) -> Server:
        server = Server("--method", "tova", "--budget", str(BUDGET), *flags)
        servers.append(server)
        server.wait_ready()
        return server

    yield started
    for server in servers:
        server.stop()


def stream_in_flight(server: Server) -> tuple[threading.Thread, dict[str, Any]]:
    """A long stream, once its sequence is live; ``out`` gets its result when it ends."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=stream, args=(server.port, out))
    thread.start()
    while server.stats()["live"]["sequences"] < 1:
        time.sleep(0.05)
    return thread, out


def test_sigterm_finishes_the_stream_in_flight_refuses_new_requests_and_exits_0(
    start: Callable[..., Server],
) -> None:
    # A drain long enough for any machine: the stream must finish, however slowly.
    server = start("--max-tokens", str(LONG), "--drain-timeout", "3600")
    thread, out = stream_in_flight(server)
    # A connection the server has accepted, whose request comes after SIGTERM.
    idle = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    idle.connect()
    time.sleep(0.5)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    idle.request("POST", "/v1/completions", body)
    refused = idle.getresponse()
    error = json.loads(refused.read())
    thread.join(timeout=600)
    code = server.process.wait(timeout=600)
    with pytest.raises(ConnectionRefusedError):
        http.client.HTTPConnection("127.0.0.1", server.port, timeout=10).connect()
    assert refused.status == 503 and int(refused.getheader("Retry-After")) >= 1
    assert "shutting down" in error["error"]["message"]
    assert out["status"] == 200 and out["done"]
    assert out["usage"]["completion_tokens"] == LONG
    assert code == 0


def test_sigterm_with_no_drain_ends_the_stream_cleanly(start: Callable[..., Server]) -> None:
    server = start("--max-tokens", str(LONG), "--drain-timeout", "0")
    thread, out = stream_in_flight(server)
    server.process.send_signal(signal.SIGTERM)
    thread.join(timeout=600)
    code = server.process.wait(timeout=600)
    assert out["status"] == 200 and out["done"]  # ended with [DONE], not cut
    assert out["usage"]["completion_tokens"] < LONG
    assert code == 0


def post(port: int, path: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    out.update(status=response.status, retry=response.getheader("Retry-After"))
    out["body"] = json.loads(response.read())
    conn.close()


def test_sigterm_refuses_the_queued_requests_with_503(start: Callable[..., Server]) -> None:
    """Requests waiting for memory when SIGTERM comes get 503 on both routes (not a 500 or a
    404), and the server exits within the drain time (2 s) and the 10 s step wait."""
    # One request's cost fits the 10 MB bound, a second waits in the queue.
    server = start("--max-tokens", str(LONG), "--drain-timeout", "2", "--max-memory", "10MB")
    thread, out = stream_in_flight(server)
    question = [{"role": "user", "content": "Hi"}]
    queued = [
        ("/v1/chat/completions", {"messages": question, "max_tokens": 4}),
        ("/v1/messages", {"messages": question, "max_tokens": 4}),
    ]
    results: list[dict[str, Any]] = [{} for _ in queued]
    waiters = [
        threading.Thread(target=post, args=(server.port, path, body, result))
        for (path, body), result in zip(queued, results, strict=True)
    ]
    for waiter in waiters:
        waiter.start()
    while server.stats()["memory_bound"]["queue"]["waiting"] < len(queued):
        time.sleep(0.05)
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    for waiter in waiters:
        waiter.join(timeout=600)
    thread.join(timeout=600)
    code = server.process.wait(timeout=600)
    assert time.monotonic() - sent < 2 + 10 + 5
    chat, messages = results
    assert chat["status"] == 503 and int(chat["retry"]) >= 1, chat
    assert "shutting down" in chat["body"]["error"]["message"]
    assert messages["status"] == 503 and int(messages["retry"]) >= 1, messages
    assert messages["body"]["error"]["type"] == "overloaded_error"
    assert "shutting down" in messages["body"]["error"]["message"]
    assert out["status"] == 200 and out["done"]
    assert code == 0


def test_sigterm_when_idle_exits_0(start: Callable[..., Server]) -> None:
    server = start()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=120) == 0
