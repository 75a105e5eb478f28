"""One huge prompt through ``velox-serve`` (issue 50's soak): the server stays usable.

    python -m velox_bench.serve_huge                      # 200k tokens, SmolLM2, TOVA(256)
    python -m velox_bench.serve_huge --prompt-tokens 20000 --out /tmp/huge.json

With ``--beyond-context`` and ``--max-prompt-tokens`` above the prompt, the run:

1. warms the server up and measures a 10-token request's time to first token when idle
   (median of three) and the idle RSS;
2. sends one streaming chat request with a ``--prompt-tokens`` prompt of real text and, once
   its prefill has started, a 10-token request: its time to first token is compared with
   ``2 x idle + one prefill chunk`` (a chunk's duration: the longest gap between two advances
   of the server's ``prefill_tokens`` while the huge prompt ran alone);
3. hangs up the huge request's client and measures how long until its sequence is freed and
   how many prompt tokens the server still ran after the hang-up (at most one chunk);
4. serves a normal request, waits for the server to be idle and compares its RSS with the idle
   value (within 5%).

It writes ``benchmarks/results/serve_huge.json`` (or ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from velox_bench.results import results_dir
from velox_bench.serve_run import ServerProcess, get_json, passage_words, stream_chat

SHORT = [{"role": "user", "content": "Say hello."}]
WORDS_PER_TOKEN = 1 / 1.3
RSS_TOLERANCE = 0.05


def _ttft(result: dict[str, Any]) -> float:
    if result.get("outcome") != "completed" or not result["arrivals"]:
        raise RuntimeError(f"the short request failed: {result}")
    return float(result["arrivals"][0] - result["start"])


class Poller:
    """Samples ``GET /v1/velox/stats`` every ``period`` seconds: (time, prefill_tokens, live)."""

    def __init__(self, port: int, period: float = 0.1) -> None:
        self.port, self.period = port, period
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                stats = get_json(self.port, "/v1/velox/stats")
            except (OSError, http.client.HTTPException, ValueError):
                return  # the server is stopping
            now = time.perf_counter()
            self.samples.append((now, stats["prefill_tokens"], stats["live"]["sequences"]))
            time.sleep(self.period)

    def longest_chunk_s(self, start: float, end: float) -> float:
        """The longest time between two advances of ``prefill_tokens`` in [start, end]."""
        advances = [
            now
            for (now, tokens, _), (_, before, _) in itertools.pairwise(self.samples)
            if start <= now <= end and tokens != before
        ]
        return max((b - a for a, b in itertools.pairwise(advances)), default=0.0)


def _wait(port: int, until: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = get_json(port, "/v1/velox/stats")
        if until(stats):
            return dict(stats)
        time.sleep(0.1)
    raise RuntimeError("timed out waiting on the server")


def run_huge(
    prompt_tokens: int,
    flags: list[str],
    chunks_alone: int = 3,
    timeout: float = 3600.0,
    say: Any = print,
) -> dict[str, Any]:
    """The run described in the module docstring; returns its figures."""
    server = ServerProcess(flags)
    try:
        server.wait_ready()
        port = server.port
        stream_chat(port, SHORT, 10)  # warm-up (and the prompt cache holds it from now on)
        idle_ttfts = [_ttft(stream_chat(port, SHORT, 10)) for _ in range(3)]
        idle_ttft = statistics.median(idle_ttfts)
        idle = _wait(port, lambda s: s["live"]["sequences"] == 0, 60)
        idle_rss = idle["memory"]["rss_bytes"]
        say(f"idle: time to first token {idle_ttft:.2f} s, RSS {idle_rss / 1e6:.0f} MB")

        words = passage_words(0)
        need = int(prompt_tokens * WORDS_PER_TOKEN)
        text = " ".join((words * (need // len(words) + 1))[:need])
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 10}
        body["stream"] = True
        poller = Poller(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        sent = time.perf_counter()
        start_tokens = idle["prefill_tokens"]
        _wait(port, lambda s: s["prefill_tokens"] > start_tokens and s["live"]["sequences"], 600)
        live_at = time.perf_counter()
        # a few chunks alone, to know how long one takes
        _wait(port, lambda s: len({p for _, p, _ in poller.samples}) > chunks_alone + 1, timeout)
        say(f"huge prompt live after {live_at - sent:.1f} s")

        short = stream_chat(port, SHORT, 10)
        busy_ttft = _ttft(short)
        # one prefill chunk: the longest the server ran, from the huge prompt's start to the
        # short request's first token (so the chunk in progress when it came is counted)
        chunk_s = poller.longest_chunk_s(live_at, short["arrivals"][0])
        bound = 2 * idle_ttft + chunk_s
        say(f"10-token request during the prefill: first token {busy_ttft:.2f} s (<= {bound:.2f})")

        before_close = get_json(port, "/v1/velox/stats")
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        closed = time.perf_counter()
        at_close = get_json(port, "/v1/velox/stats")["prefill_tokens"]
        end = _wait(port, lambda s: s["live"]["sequences"] == 0, timeout)
        freed_s = time.perf_counter() - closed
        after_close = end["prefill_tokens"] - at_close
        say(f"client hung up: freed after {freed_s:.1f} s, {after_close} prompt tokens after")
        huge_done = before_close["prefill_tokens"] - start_tokens

        normal = stream_chat(port, [{"role": "user", "content": "Name a colour."}], 10)
        settled = _wait(port, lambda s: s["live"]["sequences"] == 0, 60)
        time.sleep(2.0)  # the releaser returns what the sequences freed
        final_rss = get_json(port, "/v1/velox/stats")["memory"]["rss_bytes"]
        poller.stop.set()
        rss_change = final_rss / idle_rss - 1
        return {
            "prompt_tokens_sent": prompt_tokens,
            "flags": flags,
            "idle_ttft_s": idle_ttft,
            "idle_ttfts_s": idle_ttfts,
            "prefill_chunk_s": chunk_s,
            "busy_ttft_s": busy_ttft,
            "ttft_bound_s": bound,
            "ttft_within_bound": busy_ttft <= bound,
            "huge_prefilled_tokens_before_hangup": huge_done,
            "freed_after_hangup_s": freed_s,
            "prefill_tokens_after_hangup": after_close,
            "normal_request": normal.get("outcome"),
            "normal_text": normal.get("text"),
            "idle_rss_bytes": idle_rss,
            "final_rss_bytes": final_rss,
            "rss_change": rss_change,
            "rss_within_tolerance": abs(rss_change) <= RSS_TOLERANCE,
            "live_after": settled["live"]["sequences"],
        }
    finally:
        server.stop()


def table(result: dict[str, Any]) -> str:
    rows = [
        ("idle time to first token", f"{result['idle_ttft_s']:.2f} s"),
        ("one prefill chunk (alone)", f"{result['prefill_chunk_s']:.2f} s"),
        (
            "time to first token during the huge prefill",
            f"{result['busy_ttft_s']:.2f} s (bound {result['ttft_bound_s']:.2f} s)",
        ),
        (
            "huge prompt tokens prefilled before the hang-up",
            str(result["huge_prefilled_tokens_before_hangup"]),
        ),
        ("freed after the hang-up", f"{result['freed_after_hangup_s']:.2f} s"),
        ("prompt tokens run after the hang-up", str(result["prefill_tokens_after_hangup"])),
        ("next request", str(result["normal_request"])),
        (
            "RSS idle -> after",
            f"{result['idle_rss_bytes'] / 1e6:.0f} MB -> {result['final_rss_bytes'] / 1e6:.0f} MB "
            f"({100 * result['rss_change']:+.1f}%)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m velox_bench.serve_huge", description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=200_000)
    parser.add_argument("--model", default="embedded:smollm2-135m")
    parser.add_argument("--method", default="tova")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None, help="default: the results folder")
    args = parser.parse_args(argv)
    flags = ["--model", args.model, "--method", args.method, "--budget", str(args.budget)]
    flags += ["--beyond-context", "--max-prompt-tokens", str(args.prompt_tokens + 10_000)]
    result = run_huge(args.prompt_tokens, flags)
    print(table(result))
    out = args.out or results_dir() / "serve_huge.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
