"""``velox-serve``: a real server process on a free port with the embedded model, talked to
with the official ``openai`` client and raw HTTP.

CI runs a few short requests on two servers (TOVA with a budget below the prompts; the same
with no prompt cache, the cold reference). The long-prompt concurrency test (6 clients,
1-2.5k-token prompts) runs under ``nox -s serve`` (``VELOX_SERVE_LONG=1``).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

BUDGET = 48
TOKENS = 16
QUESTION = "In one sentence, what does the passage say about plants?"
LONG = os.environ.get("VELOX_SERVE_LONG") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``velox-serve`` in a subprocess, its log in a temporary file. ``key``: the API key it
    requires and the helpers send; ``code``: Python run instead of ``-m velox_mlx_lm.serve``
    (it gets the flags as ``sys.argv[1:]``)."""

    key: str | None = None  # subclasses that start the server their own way send no key

    def __init__(self, *flags: str, key: str | None = None, code: str | None = None) -> None:
        self.port = free_port()
        self.key = key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        entry = ["-m", "velox_mlx_lm.serve"] if code is None else ["-c", code]
        argv = [sys.executable, *entry, "--port", str(self.port), *flags]
        if key is not None:
            argv += ["--api-key", key]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"velox-serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if self.stats()["ready"]:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        pytest.fail(f"velox-serve not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-4000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON body); ``body`` bytes are sent as they are; ``headers``
        replace the API key header the helper sends by default."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        auth = {} if self.key is None else {"Authorization": f"Bearer {self.key}"}
        headers = {"Content-Type": "application/json", **(auth if headers is None else headers)}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        return response.status, json.loads(raw)

    def stats(self) -> Any:
        return self.request("GET", "/v1/velox/stats")[1]

    def client(self) -> Any:
        import openai

        key = self.key or "unused"
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def servers(embedded_model_path: Any) -> Iterator[tuple[Server, Server]]:
    """(TOVA budget 48 with the prompt cache, the same with none): started together. Their
    system prompts are longer than the budget, so nothing is pinned (``--max-pinned 0``;
    pinning has its own tests, test_serve_pins.py)."""
    flags = ["--method", "tova", "--budget", str(BUDGET), "--max-tokens", str(TOKENS)]
    flags += ["--max-pinned", "0"]
    warm = Server(*flags)
    cold = Server(*flags, "--prompt-cache-size", "0")
    try:
        warm.wait_ready()
        cold.wait_ready()
        yield warm, cold
    finally:
        warm.stop()
        cold.stop()


def passage(words: int) -> str:
    from velox_mlx_lm.embedded import paragraph

    text = paragraph().split()
    return " ".join((text * (words // len(text) + 1))[:words])


def chat(server: Server, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    kwargs = {"temperature": 0.0, "max_tokens": TOKENS, **kwargs}
    return server.client().chat.completions.create(
        model="velox-embedded", messages=messages, **kwargs
    )


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_equals_velox_generate_and_streaming(servers: tuple[Server, Server]) -> None:
    warm, _ = servers
    prompt = f"{passage(90)}\n\n{QUESTION}"
    reply = chat(warm, user(prompt))
    answer = reply.choices[0].message.content
    usage = reply.usage
    velox = usage.model_extra["velox"]
    assert usage.prompt_tokens > BUDGET  # the cache evicted
    assert velox["method"] == "tova" and velox["tokens_kept"] == BUDGET
    assert velox["tokens_seen"] > BUDGET and velox["compression_ratio"] > 1.0
    assert 0 < velox["kv_bytes"] <= velox["cache_bytes"]

    argv = ["--prompt", prompt, "--chat", "--method", "tova", "--budget", str(BUDGET)]
    argv += ["--max-tokens", str(TOKENS), "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "velox_mlx_lm.cli", *argv], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    generated = json.loads(out.stdout)["runs"][-1]["answer"]
    assert answer.strip() == generated.strip()

    stream = chat(warm, user(prompt), stream=True, stream_options={"include_usage": True})
    parts, last_usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            last_usage = chunk.usage
    assert "".join(parts) == answer
    assert last_usage is not None and last_usage.model_extra["velox"]["tokens_kept"] == BUDGET


def test_text_completion_and_models(servers: tuple[Server, Server]) -> None:
    warm, _ = servers
    models = [m.id for m in warm.client().models.list().data]
    assert models == ["velox-embedded"]
    reply = warm.client().completions.create(
        model="velox-embedded", prompt=passage(70), max_tokens=8, temperature=0.0
    )
    assert reply.choices[0].text
    assert reply.usage.model_extra["velox"]["tokens_kept"] <= BUDGET


def test_shared_system_prompt_reuses_the_prompt_cache_exactly(
    servers: tuple[Server, Server],
) -> None:
    warm, cold = servers
    system = {"role": "system", "content": passage(160)}
    first = chat(warm, [system, *user("What is the passage about?")])
    assert first.choices[0].message.content
    second = [system, *user(QUESTION)]
    reused = chat(warm, second)
    cached = reused.usage.prompt_tokens_details.cached_tokens
    assert cached > BUDGET  # the shared system prompt came from the prompt cache
    fresh = chat(cold, second)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert reused.choices[0].message.content == fresh.choices[0].message.content

    stats = warm.stats()
    assert stats["prompt_cache"]["sequences"] >= 1 and stats["prompt_cache"]["bytes"] > 0
    assert stats["max_tokens_kept_since_start"] <= BUDGET


BAD_REQUESTS = [
    (b"{not json", 400),
    ({"max_tokens": 4}, 400),  # no messages
    ({"messages": []}, 400),
    ({"messages": "hello"}, 400),
    ({"messages": [{"content": "hi"}]}, 400),  # no role
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 404),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400),  # > 8192-token context
]


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(
    servers: tuple[Server, Server],
) -> None:
    warm, _ = servers
    for body, status in BAD_REQUESTS:
        got, error = warm.request("POST", "/v1/chat/completions", body)
        assert got == status, (body if isinstance(body, bytes) else json.dumps(body)[:80], error)
        assert "error" in error
    got, _ = warm.request("POST", "/v1/completions", {"prompt": 7})
    assert got == 400
    got, reply = warm.request("POST", "/v1/chat/completions", {"messages": user("Hi!")})
    assert got == 200 and reply["choices"][0]["message"]["content"]


def test_client_leaving_mid_stream_frees_its_sequence(servers: tuple[Server, Server]) -> None:
    warm, _ = servers
    other = user(f"{passage(60)}\n\n{QUESTION}")
    alone = chat(warm, other).choices[0].message.content

    body = {"messages": user("Write a long story about a dragon."), "max_tokens": 400}
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", warm.port), timeout=300)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    stream = sock.makefile("rb")
    assert b" 200 " in stream.readline()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(reply=chat(warm, other)))
    thread.start()
    chunks = 0
    while chunks < 6:
        chunks += stream.readline().startswith(b"data: ")
    assert warm.stats()["live"]["sequences"] >= 1
    sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    sock.close()
    thread.join()
    assert result["reply"].choices[0].message.content == alone

    deadline = time.monotonic() + 120
    while warm.stats()["live"]["sequences"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert warm.stats()["live"]["sequences"] == 0  # the dragon story's sequence is gone
    assert chat(warm, user("Hi!")).choices[0].message.content


def concurrent_answers(
    server: Server, prompts: list[str], tokens: int, timeout: float | None = None
) -> list[str]:
    answers: list[str] = [""] * len(prompts)
    errors: list[BaseException] = []
    budget = int(server.stats()["budget"])

    def ask(i: int) -> None:
        try:
            extra = {} if timeout is None else {"timeout": timeout}
            reply = chat(server, user(prompts[i]), max_tokens=tokens, **extra)
            answers[i] = reply.choices[0].message.content
            assert reply.usage.model_extra["velox"]["tokens_kept"] <= budget
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return answers


def test_concurrent_clients_equal_their_answers_alone(servers: tuple[Server, Server]) -> None:
    """Three clients at once (short prompts, above the budget): batched rows equal each
    request served alone."""
    warm, cold = servers
    prompts = [f"{passage(n)}\n\n{QUESTION}" for n in (50, 80, 110)]
    together = concurrent_answers(warm, prompts, TOKENS)
    alone = [chat(cold, user(p)).choices[0].message.content for p in prompts]
    assert together == alone
    assert warm.stats()["max_tokens_kept_since_start"] <= BUDGET


@pytest.mark.skipif(not LONG, reason="long prompts: run by `nox -s serve` (VELOX_SERVE_LONG=1)")
def test_six_clients_long_prompts(embedded_model_path: Any) -> None:
    """6 clients at once, prompts of 1-2.5k tokens, budget 256: all complete, each equals
    its one-at-a-time answer, and no live sequence ever kept more than the budget. A 2-core CPU
    needs minutes for this, so the requests get a one-hour client timeout."""
    budget = 256
    flags = ["--method", "tova", "--budget", str(budget), "--prompt-cache-size", "0"]
    server = Server(*flags)
    try:
        server.wait_ready()
        prompts = [f"{passage(800 + 220 * i)}\n\n{QUESTION}" for i in range(6)]
        together = concurrent_answers(server, prompts, 24, timeout=3600.0)
        alone = []
        for p in prompts:
            reply = chat(server, user(p), max_tokens=24, timeout=3600.0)
            assert 1000 <= reply.usage.prompt_tokens <= 3000
            alone.append(reply.choices[0].message.content)
        assert together == alone
        assert server.stats()["max_tokens_kept_since_start"] <= budget
    finally:
        server.stop()
