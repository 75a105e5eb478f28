"""Faults on ``velox-serve`` (issue 33, point 5): clients killed mid-stream, and SIGTERM while
streams are in flight.

- :func:`kill_clients`: client processes stream long replies; each is killed (SIGKILL) once
  its first token has arrived. The server must free their sequences and go on serving.
- :func:`sigterm_under_load`: streams in flight, then SIGTERM to the server. Each stream must
  end cleanly (``[DONE]``) or have been refused (503 with ``Retry-After``); a request made
  during the drain must be refused (503, or the connection refused); the server must exit 0;
  and a server started again on the same port must answer a request as soon as it is ready.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from velox_bench.serve_run import ServerProcess, get_json, stream_chat

# A client process: streams one chat reply and prints one line per chunk (so the parent knows
# when the first token has arrived), until it is killed.
CLIENT = """
import http.client, json, sys
port, tokens = int(sys.argv[1]), int(sys.argv[2])
body = {"messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
        "max_tokens": tokens, "temperature": 0.0, "stream": True}
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
response = conn.getresponse()
for line in iter(response.readline, b""):
    if line.startswith(b"data: "):
        print("chunk", flush=True)
"""
MESSAGES = [{"role": "user", "content": "Tell a long story about a lighthouse."}]


def kill_clients(flags: list[str], clients: int, gen_tokens: int) -> dict[str, Any]:
    """Start ``clients`` client processes, kill each after its first token, then check that
    the server has no live sequence left and serves a new request."""
    server = ServerProcess(flags)
    try:
        server.wait_ready()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CLIENT, str(server.port), str(gen_tokens)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(clients)
        ]
        killed_after_chunk = 0
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline():  # the first chunk (the role) has arrived
                proc.stdout.readline()  # and the first token
                killed_after_chunk += 1
            proc.kill()
            proc.wait()
        live = _wait_live_zero(server.port, timeout=120.0)
        after = stream_chat(server.port, MESSAGES, 8)
        stats = _wait_memory_idle(server.port, timeout=30.0)
        alive = server.process.poll() is None
    finally:
        server.stop()
    return {
        "clients": clients,
        "killed_mid_stream": killed_after_chunk,
        "live_sequences_after": live,
        "request_after": after["outcome"],
        "server_alive": alive,
        "memory_bound_after": stats.get("memory_bound"),
    }


def _wait_live_zero(port: int, timeout: float) -> int:
    """Live sequences once they reach 0 (or at the timeout): disconnects are noticed at the
    next token written."""
    deadline = time.monotonic() + timeout
    live = -1
    while time.monotonic() < deadline:
        live = int(get_json(port, "/v1/velox/stats")["live"]["sequences"])
        if live == 0:
            break
        time.sleep(0.25)
    return live


def _wait_memory_idle(port: int, timeout: float) -> dict[str, Any]:
    """The stats once the memory bound holds no reservation and runs nothing (or at the
    timeout): the last request's reservation is given back just after its stream ends."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_json(port, "/v1/velox/stats")
        bound = stats.get("memory_bound") or {}
        idle = not bound.get("reserved_bytes") and not bound.get("running")
        if idle or time.monotonic() >= deadline:
            return stats
        time.sleep(0.25)


def _probe(port: int) -> str:
    """A request during the drain: ``refused_503``, ``connection_refused`` or what else."""
    try:
        result = stream_chat(port, MESSAGES, 4)
    except OSError:
        return "connection_refused"
    if result["outcome"] == "refused":
        return "refused_503"
    if result["outcome"] == "lost" and "Connection refused" in str(result.get("detail")):
        return "connection_refused"
    return str(result["outcome"])


def sigterm_under_load(flags: list[str], streams: int, gen_tokens: int) -> dict[str, Any]:
    """``streams`` streams in flight, SIGTERM, then the outcomes, the exit status and a
    restarted server's first answer."""
    server = ServerProcess(flags)
    results: list[dict[str, Any]] = [{} for _ in range(streams)]
    try:
        server.wait_ready()
        threads = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    i, stream_chat(server.port, MESSAGES, gen_tokens)
                )
            )
            for i in range(streams)
        ]
        for t in threads:
            t.start()
        _wait_streaming(server.port, streams, timeout=300.0)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        time.sleep(0.2)
        probe = _probe(server.port)
        for t in threads:
            t.join(timeout=600)
        code = server.process.wait(timeout=600)
        exit_s = time.perf_counter() - signalled
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
        log = Path(server.log.name).read_text()
        server.log.close()
        os.unlink(server.log.name)
    restarted = ServerProcess(flags, port=server.port)
    try:
        started = time.perf_counter()
        restarted.wait_ready()
        ready_s = time.perf_counter() - started
        first = stream_chat(restarted.port, MESSAGES, 8)
    finally:
        restarted.stop()
    outcomes = [r.get("outcome", "missing") for r in results]
    return {
        "streams": streams,
        "outcomes": outcomes,
        "completion_tokens": [(r.get("usage") or {}).get("completion_tokens") for r in results],
        "probe_during_drain": probe,
        "exit_code": code,
        "drain_timed_out": "drain timed out" in log,
        "exit_after_sigterm_s": exit_s,
        "restart_ready_s": ready_s,
        "restart_first_request": first["outcome"],
    }


def _wait_streaming(port: int, streams: int, timeout: float) -> None:
    """Until ``streams`` sequences are live (every stream is generating)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if get_json(port, "/v1/velox/stats")["live"]["sequences"] >= streams:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{streams} streams never ran at once")
