"""``velox_bench.exit_check`` tells a prompt exit from a hang, on stand-in commands (no model)."""

from __future__ import annotations

import sys

import pytest

from velox_bench import exit_check

REPORT = "print('{'); print('  \"a\": 1'); print('}', flush=True)"
STAND_INS = {
    "prompt": REPORT,
    "hang": REPORT + "; import time; time.sleep(60)",
    "silent": "import time; time.sleep(60)",
}


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        exit_check, "command", lambda model, _: [sys.executable, "-c", STAND_INS[model]]
    )


def test_the_issue_command() -> None:
    cmd = exit_check.command("embedded:gemma3-270m", 8)
    assert cmd[1:3] == ["-m", "velox_mlx_lm.cli"]
    assert cmd[3:5] == ["--model", "embedded:gemma3-270m"] and cmd[-2:] == ["--max-tokens", "8"]
    assert "--model" not in exit_check.command("default", 8)


def test_exit_hang_and_no_report(stand_ins: None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--runs", "3", "--models", "prompt", "hang", "silent", "--grace", "2"]
    assert exit_check.main([*argv, "--report-timeout", "5"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("exited") and out[1].endswith("hung") and out[2].endswith("no report")
    assert out[3].startswith("prompt: 1/1 exited within 2 s of the report, 0 hung")
    assert out[4].startswith("hang: 0/1 exited within 2 s of the report, 1 hung")
    assert out[5].startswith("silent: 0/1 exited within 2 s of the report, 0 hung, 1 other")


def test_all_prompt_exits_pass(stand_ins: None) -> None:
    assert exit_check.main(["--runs", "2", "--models", "prompt", "--grace", "5"]) == 0
