"""The process's resident memory under many conversations against a small ``--max-memory``
(issue 33): it stays within weights + bound + a stated margin, and what serving adds to the
RSS at start stays within the bound + a stated margin for activations.

Margins, stated: ``MARGIN`` (512 MiB) is everything a process holds besides weights and KV:
the interpreter and its libraries, the tokenizer, the buffers of loading the GGUF, prefill
activations and MLX's buffer cache. ``ACTIVATION_MARGIN`` (128 MiB) is what requests may add
besides their KV: activations of the prefill steps (prompts of ~50-150 tokens here), the
buffer cache and the HTTP threads. Measured on Linux (2 CPUs, float32 model of 538 MB): peak
RSS 835 MB (at load), +50 MB over the RSS at ready after 16 conversations.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from test_serve import BUDGET, TOKENS, Server
from test_serve_agents import converse

pytestmark = [pytest.mark.model, pytest.mark.slow]

BOUND = 16_000_000
MIB = 1 << 20
MARGIN = 512 * MIB
ACTIVATION_MARGIN = 128 * MIB
CONVERSATIONS = 16


def test_rss_stays_within_weights_bound_and_margin(embedded_model_path: Any) -> None:
    from velox_mlx_lm.embedded import load_default
    from velox_mlx_lm.serve_memory import weight_bytes

    weights = weight_bytes(load_default()[0])
    flags = ["--method", "tova", "--budget", str(BUDGET), "--max-tokens", str(TOKENS)]
    server = Server(*flags, "--max-memory", str(BOUND), "--max-queue", "2")
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(server.stats()["memory"]["rss_bytes"])
            time.sleep(0.2)

    try:
        server.wait_ready()
        at_ready = server.stats()["memory"]["rss_bytes"]
        sampler = threading.Thread(target=sample)
        sampler.start()
        outcomes: list[Any] = []
        threads = [
            threading.Thread(target=converse, args=(server, i, outcomes))
            for i in range(CONVERSATIONS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        final = server.stats()
    finally:
        server.stop()
    assert {status for status, _, _ in outcomes} <= {200, 503}
    assert sum(status == 200 for status, _, _ in outcomes) >= 2
    assert final["memory_bound"]["peak_used_bytes"] <= BOUND
    peak = max([*samples, final["memory"]["rss_bytes"], final["memory"]["rss_peak_bytes"]])
    assert peak <= weights + BOUND + MARGIN, (peak, weights)
    assert max(samples) - at_ready <= BOUND + ACTIVATION_MARGIN, (max(samples), at_ready)
