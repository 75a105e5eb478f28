"""What the ``velox-serve`` benchmarks share: a server subprocess on a free port, JSON GETs,
streamed chat turns classified by outcome, and one run's scaffold (the server up, a sampler
polling ``GET /v1/velox/stats``, one thread per conversation, the final stats, the server down).

Plain ``http.client``: nothing to install, and each SSE chunk is timestamped as it arrives.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

STATS_PATH = "/v1/velox/stats"
SERVE = ("-m", "velox_mlx_lm.serve")  # how the server starts, after the interpreter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return json.loads(body)


class ServerProcess:
    """``velox-serve`` with ``flags`` in a subprocess on a free port (or ``port``); ``entry``
    replaces ``-m velox_mlx_lm.serve`` (a ``-c`` script that patches the server first).
    ``stop()`` always."""

    def __init__(
        self, flags: Sequence[str], port: int | None = None, entry: Sequence[str] = SERVE
    ) -> None:
        self.port = free_port() if port is None else port
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        argv = [sys.executable, *entry, "--port", str(self.port), *flags]
        argv += ["--log-level", "WARNING"]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"velox-serve exited:\n{Path(self.log.name).read_text()}")
            try:
                if get_json(self.port, STATS_PATH)["ready"]:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError("velox-serve did not become ready")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


def stream_chat(
    port: int, messages: list[dict[str, str]], max_tokens: int, timeout: float = 3600
) -> dict[str, Any]:
    """One streaming greedy chat request, classified: ``outcome`` is ``completed`` (HTTP 200,
    the stream ended with ``[DONE]`` and a usage chunk), ``refused`` (a 503 with
    ``Retry-After``) or ``lost`` (anything else); with its text, chunk arrival times, usage."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read()[:300].decode(errors="replace")
            refused = response.status == 503 and response.getheader("Retry-After") is not None
            outcome = "refused" if refused else "lost"
            return {"outcome": outcome, "status": response.status, "detail": detail}
        read = read_stream(response)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"outcome": "lost", "status": None, "detail": repr(exc)}
    finally:
        conn.close()
    outcome = "completed" if read["done"] and read["usage"] is not None else "lost"
    return {"outcome": outcome, "status": 200, "start": started, **read}


def read_stream(response: Any) -> dict[str, Any]:
    """An SSE chat stream: its text, each content chunk's arrival time, the usage chunk and
    whether it ended with ``[DONE]``."""
    arrivals: list[float] = []
    text, usage, done = "", None, False
    for line in iter(response.readline, b""):
        data = line[6:].strip() if line.startswith(b"data: ") else None
        if data == b"[DONE]":
            done = True
            break
        if not data:
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                arrivals.append(time.perf_counter())
                text += piece
    return {"arrivals": arrivals, "text": text, "usage": usage, "done": done}


def passage_words(offset: int) -> list[str]:
    """Words of real text (the embedded model's paragraph, rotated per conversation so that
    conversations share no prefix)."""
    from velox_mlx_lm.embedded import paragraph

    words = paragraph().split()
    offset %= len(words)
    return words[offset:] + words[:offset]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def stats_sample(stats: dict[str, Any], t_s: float) -> dict[str, Any]:
    """One timeline row from a ``GET /v1/velox/stats`` body."""
    return {
        "t_s": t_s,
        **stats["memory"],
        "live_sequences": stats["live"]["sequences"],
        "live_kv_bytes": stats["live"]["kv_bytes"],
        "prompt_cache_bytes": stats["prompt_cache"]["bytes"],
        "bound_used_bytes": (stats.get("memory_bound") or {}).get("used_bytes"),
    }


def run_conversations(
    server: ServerProcess,
    conversations: int,
    converse: Callable[[int, float], None],
    poll_s: float,
) -> dict[str, Any]:
    """Wait for ``server``, run ``converse(index, t0)`` in one thread per conversation while a
    sampler polls the stats every ``poll_s`` seconds, then stop the server (always).

    Returns ``wall_s`` (from ``t0`` to the last conversation's end), ``timeline`` (one
    :func:`stats_sample` per poll) and ``final`` (the stats once every conversation ended)."""
    try:
        server.wait_ready()
        timeline: list[dict[str, Any]] = []
        stop = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                stats = get_json(server.port, STATS_PATH)
                timeline.append(stats_sample(stats, time.perf_counter() - t0))
                stop.wait(poll_s)

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=converse, args=(i, t0)) for i in range(conversations)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        final = get_json(server.port, STATS_PATH)
    finally:
        server.stop()
    return {"wall_s": wall, "timeline": timeline, "final": final}
