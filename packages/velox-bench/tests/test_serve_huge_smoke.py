"""CI-sized run of ``python -m velox_bench.serve_huge`` (issue 50's soak): a prompt past the
budget from the first chunks on (TOVA(16), chunks of at most 32 tokens), a short request
while it is prefilled, the huge client hanging up, a normal request after."""

from __future__ import annotations

from typing import Any

import pytest

from velox_bench.serve_huge import run_huge, table

CHUNK = 32


@pytest.mark.slow  # one server, a prompt of about 1,500 tokens prefilled token by token
@pytest.mark.model
def test_serve_huge_smoke(embedded_model: None) -> None:
    flags = ["--method", "tova", "--budget", "16", "--prefill-step-size", str(CHUNK)]
    flags += ["--beyond-context", "--max-prompt-tokens", "4000"]
    lines: list[str] = []
    out: dict[str, Any] = run_huge(1500, flags, chunks_alone=2, say=lines.append)
    assert out["busy_ttft_s"] > 0 and out["prefill_chunk_s"] > 0
    # the huge prompt was cut short: it needed dozens of chunks, ran a few
    assert 0 < out["huge_prefilled_tokens_before_hangup"] < 1500
    # after the hang-up, at most the chunk in progress (never more than --prefill-step-size)
    assert 0 <= out["prefill_tokens_after_hangup"] <= CHUNK
    assert out["normal_request"] == "completed" and out["live_after"] == 0
    assert out["idle_rss_bytes"] > 0 and out["final_rss_bytes"] > 0
    assert "next request" in table(out) and len(lines) == 4
