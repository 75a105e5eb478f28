"""CI-sized run of ``python -m velox_bench.serve_huge`` (issue 50's soak): a 6,000-token prompt
past the budget from the first chunks on (TOVA(16), chunks of at most 32 tokens), a short
request while it is prefilled, the huge client hanging up, a normal request after."""

from __future__ import annotations

from typing import Any

import pytest

from velox_bench.serve_huge import run_huge, table

CHUNK = 32


@pytest.mark.slow  # one server; the 6,000-token prompt is hung up on a few chunks in
@pytest.mark.model
def test_serve_huge_smoke(embedded_model: None) -> None:
    flags = ["--method", "tova", "--budget", "16", "--prefill-step-size", str(CHUNK)]
    flags += ["--beyond-context", "--max-prompt-tokens", "8000"]
    lines: list[str] = []
    out: dict[str, Any] = run_huge(6000, flags, chunks_alone=2, say=lines.append)
    assert out["busy_ttft_s"] > 0 and out["prefill_chunk_s"] > 0
    # the huge prompt was cut short: it needed about 190 chunks, ran a few (even on a fast
    # machine the short request's ten steps run ten chunks, not a hundred)
    assert 0 < out["huge_prefilled_tokens_before_hangup"] < 6000
    # after the hang-up, at most the chunk in progress (never more than --prefill-step-size)
    assert 0 <= out["prefill_tokens_after_hangup"] <= CHUNK
    assert out["normal_request"] == "completed" and out["live_after"] == 0
    assert out["idle_rss_bytes"] > 0 and out["final_rss_bytes"] > 0
    assert "next request" in table(out) and len(lines) == 4
