"""A request whose client leaves stops within one prefill chunk, on both routes, streaming and
not, and its memory reservation is released once its sequence is freed (issue 50); the prefill
chunk is sized by time (``serve/pacing.py``); ``--max-prompt-tokens`` bounds prompts with
``--beyond-context`` too."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from mlx_lm.server import GenerationContext
from test_serve import Server, passage

from velox_mlx_lm.serve.pacing import (
    ALONE_S,
    GROWTH,
    INTERLEAVE_S,
    MIN_CHUNK,
    PROBE_CHUNK,
    Pacer,
)
from velox_mlx_lm.serve.sequences import SequenceTracker, TrackedQueue, client_gone, freed_of

# -- the pacer ---------------------------------------------------------------------------------


def test_pacer_probes_first_then_sizes_chunks_by_time() -> None:
    pacer = Pacer(2048)
    assert pacer.chunk(others_live=False) == PROBE_CHUNK
    pacer.measured(PROBE_CHUNK, PROBE_CHUNK * 0.001)  # 1 ms a token
    # growth is capped at GROWTH times the last chunk
    assert pacer.chunk(others_live=False) == GROWTH * PROBE_CHUNK
    for _ in range(8):
        pacer.measured(pacer.chunk(others_live=False), 0.001 * pacer.chunk(others_live=False))
    assert pacer.chunk(others_live=False) == min(2048, int(ALONE_S / 0.001))
    # others live: a chunk of about INTERLEAVE_S, a multiple of MIN_CHUNK
    chunk = pacer.chunk(others_live=True)
    assert chunk == int(INTERLEAVE_S / 0.001) - int(INTERLEAVE_S / 0.001) % MIN_CHUNK


def test_pacer_shrinks_at_once_when_tokens_get_dear_and_keeps_its_bounds() -> None:
    pacer = Pacer(512)
    pacer.measured(64, 0.064)
    pacer.measured(128, 128 * 0.5)  # half a second a token (past the budget)
    # sized from the newest rate alone: a second of prefill is two tokens, so MIN_CHUNK
    assert pacer.chunk(others_live=True) == MIN_CHUNK
    assert pacer.chunk(others_live=False) == 16  # ten seconds: 20 tokens, a multiple of 16
    small = Pacer(8)
    assert small.chunk(others_live=False) == 8  # never above --prefill-step-size
    with pytest.raises(ValueError, match="--prefill-step-size"):
        Pacer(0)


# -- noticing a client that left ---------------------------------------------------------------


def test_client_gone_sees_a_close_without_consuming_data() -> None:
    server, client = socket.socketpair()
    try:
        assert not client_gone(server)
        client.sendall(b"x")  # pending data: still there, and not consumed
        assert not client_gone(server)
        assert server.recv(1) == b"x"
        client.close()
        assert client_gone(server)
        assert not client_gone(None)
    finally:
        server.close()
    assert client_gone(server)  # closed under us


def _context() -> GenerationContext:
    return GenerationContext(
        has_tool_calling=False,
        has_thinking=False,
        tool_parser=None,  # type: ignore[arg-type]
        text_sm=None,  # type: ignore[arg-type]
        initial_state="normal",
        prompt=[1, 2, 3],
    )


class _Queue:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


def test_tracker_maps_uids_stops_sequences_of_gone_clients_and_marks_them_freed() -> None:
    tracker = SequenceTracker()
    server, client = socket.socketpair()
    request, inner = object(), _Queue()
    tracker.register(request, server)
    rqueue, body = tracker.wrap((inner, request, "args"))[:2]
    assert isinstance(rqueue, TrackedQueue) and body is request and rqueue.socket is server
    ctx = _context()
    rqueue.put(ctx)  # what the generation thread does just before insert_segments
    tracker.inserted([7])
    assert inner.items == [ctx] and tracker.stopped() == []
    freed = freed_of(ctx)
    assert freed is not None and not freed.event.is_set()
    client.close()
    assert tracker.stopped() == [7] and ctx._should_stop  # the client left: stopped
    tracker.freed([7])
    assert freed.event.is_set() and tracker.stopped() == []
    server.close()


def test_tracker_stops_what_the_handler_stopped_and_clears_on_close() -> None:
    tracker = SequenceTracker()
    contexts = []
    for uid in (1, 2):
        rqueue = tracker.wrap((_Queue(), object(), None))[0]
        ctx = _context()
        rqueue.put(ctx)
        tracker.inserted([uid])
        contexts.append(ctx)
    contexts[1].stop()  # e.g. a stop sequence inside a token
    assert tracker.stopped() == [2]
    tracker.clear()
    assert all(freed_of(c).event.is_set() for c in contexts)  # type: ignore[union-attr]


def test_a_cancelled_one_at_a_time_prefill_ends_at_its_next_progress_report() -> None:
    tracker = SequenceTracker()
    rqueue = tracker.wrap((_Queue(), object(), None))[0]
    rqueue.alone = True
    ctx = _context()
    rqueue.put(ctx)
    rqueue.put((64, 512))  # progress goes through while the request runs
    ctx.stop()
    with pytest.raises(ConnectionResetError):
        rqueue.put((128, 512))
    rqueue.put(None)  # the end and errors still go through
    tracker.served_alone((rqueue, None, None))
    assert freed_of(ctx).event.is_set()  # type: ignore[union-attr]


# -- through the server ------------------------------------------------------------------------

CHUNK = 32  # --prefill-step-size: the most a prefill chunk can be


@pytest.fixture(scope="module")
def server(embedded_model_path: Any) -> Iterator[Server]:
    """TOVA past its budget from the first chunks on (so a prefill runs token by token and a
    long prompt takes many chunks), small chunks, prompts past the context allowed."""
    flags = ["--method", "tova", "--budget", "16", "--prefill-step-size", str(CHUNK)]
    flags += ["--beyond-context", "--max-prompt-tokens", "3000", "--max-tokens", "8"]
    srv = Server(*flags)
    srv.wait_ready()
    yield srv
    srv.stop()


def _send(server: Server, route: str, stream: bool, prompt: str) -> http.client.HTTPConnection:
    messages = [{"role": "user", "content": prompt}]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 8, "stream": stream}
    path = "/v1/chat/completions"
    if route == "messages":
        path, body["model"] = "/v1/messages", "default_model"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn


def _wait(server: Server, until: Any, timeout: float = 600.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.stats()
        if until(stats):
            return stats
        time.sleep(0.05)
    pytest.fail(f"timed out waiting on the server:\n{server.tail()}")


@pytest.mark.model
@pytest.mark.parametrize("route", ["chat", "messages"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_leaves_during_prefill_stops_it_within_one_chunk(
    server: Server, route: str, stream: bool
) -> None:
    idle = _wait(server, lambda s: s["live"]["sequences"] == 0)
    idle_used = (idle["memory_bound"] or {}).get("used_bytes")
    conn = _send(server, route, stream, passage(900))
    # the prompt is live and a few chunks in (it needs dozens)
    started = idle["prefill_tokens"]
    _wait(
        server,
        lambda s: s["live"]["sequences"] == 1 and s["prefill_tokens"] >= started + 2 * CHUNK,
    )
    reserved = (server.stats()["memory_bound"] or {}).get("used_bytes")
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    at_close = server.stats()["prefill_tokens"]
    end = _wait(server, lambda s: s["live"]["sequences"] == 0)
    # at most the chunk that was running when the client left
    assert end["prefill_tokens"] - at_close <= CHUNK
    # a reservation was held while the sequence lived, and is gone with it
    if idle_used is not None:
        assert reserved > idle_used
        _wait(server, lambda s: s["memory_bound"]["used_bytes"] <= idle_used, timeout=30)


@pytest.mark.model
def test_max_prompt_tokens_applies_past_the_context_on_both_routes(server: Server) -> None:
    long_prompt = passage(3000)  # about 4,000 tokens > --max-prompt-tokens 3000
    conn = _send(server, "messages", False, long_prompt)
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 400
    assert body["error"]["message"].startswith("prompt is too long: ")
    assert "> 3000 maximum" in body["error"]["message"]
    conn = _send(server, "chat", False, long_prompt)
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    assert response.status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "--max-prompt-tokens" in body["error"]["message"]
