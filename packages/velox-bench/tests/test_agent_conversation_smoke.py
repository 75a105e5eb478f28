"""CI-sized run of ``python -m velox_bench.agent_conversation`` (issue 49's agent bench): a few
short turns through a real server and the anthropic client, TOVA with pins and compact
positions; and the degenerate-reply check by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from velox_bench.agent_conversation import degenerate, main, script


def test_degenerate_replies() -> None:
    assert degenerate("") and degenerate("\n\n \n")
    assert degenerate("The\n\nThe\n\nThe\n\nThe\n\n")
    assert degenerate("How to How to How to How to How to")
    assert not degenerate("The code name is HERON.")
    assert not degenerate("It defines a helper that copies attributes from one class to another.")


def test_script_asks_about_the_system_prompt_and_the_first_output() -> None:
    turns = script(12, 300)
    asked = [t for t in turns if t.answer is not None]
    assert len(asked) == 4 and {t.where for t in asked} == {"system", "early"}
    assert "KESTREL" in turns[0].text


@pytest.mark.slow
@pytest.mark.model
def test_agent_conversation_smoke(embedded_model: None, tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    assert main(["--quick", "--configs", "tova-pinned-compact", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    summary = result["summary"]["tova-pinned-compact"]
    assert summary["turns"] == 5 and not summary["stopped"]
    pinned = [r["pinned_tokens"] for r in result["configs"][0]["turns"]]
    assert min(pinned) > 20  # the system prompt and the tool definition
