"""``python -m velox_bench.exit_check``: does ``velox-generate`` exit promptly after answering?

Issue 50 (item 0): ``velox-generate --json`` printed its answer and then sometimes never exited.
OpenBLAS's exit-time destructor joined a worker thread that had gone back to sleep, because MLX's
stream thread was still inside a multithreaded BLAS call (the decode step mlx-lm evaluates ahead)
when the process exited. ``velox_blas`` now stops OpenBLAS's threads itself, at exit, once MLX has
finished (see docs/architecture.md, "Speed on Linux CPU"). This runs the issue's command N times,
alternating the models (Gemma 3 270M first, then the default SmolLM2), and measures the time from
the end of the JSON report on stdout to the process's exit:

    python -m velox_bench.exit_check --runs 50
    python -m velox_bench.exit_check --runs 4 --models embedded:gemma3-270m --gdb

A run counts as exited when the process ends within ``--grace`` seconds (10) of its last line of
JSON; a run that does not is killed (with ``--gdb``, after printing every thread's stack). Each
run is ``python -m velox_mlx_lm.cli ...`` with this interpreter (what the ``velox-generate``
console script runs), so ``PYTHONPATH`` and the environment carry over. The command imports only
the standard library: it starts no mlx itself. Exits 1 when any run hung or gave no report.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MODELS = ("embedded:gemma3-270m", "default")
ISSUE_ARGS = (
    "--method",
    "tova",
    "--budget",
    "128",
    "--prompt",
    "The capital of France is",
    "--json",
)


@dataclass
class Outcome:
    """One run: how long until the report, then until the exit (``None``: it did not)."""

    model: str
    report_s: float | None = None
    exit_after_report_s: float | None = None
    returncode: int | None = None
    stacks: str = ""

    @property
    def verdict(self) -> str:
        if self.report_s is None:
            return "no report"
        if self.exit_after_report_s is None:
            return "hung"
        return "exited" if self.returncode == 0 else f"exited rc={self.returncode}"


@dataclass
class _Watch:
    """Reads a child's stdout on a thread; notes when the JSON report's closing line came."""

    process: subprocess.Popen[str]
    done: threading.Event = field(default_factory=threading.Event)
    at: float | None = None

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.rstrip("\n") == "}":  # json.dumps(indent=2) ends the report with it
                self.at = time.monotonic()
                self.done.set()
        self.done.set()  # stdout closed: exited, or died before a report


def command(model: str, max_tokens: int) -> list[str]:
    """The issue's ``velox-generate`` command for ``model`` (``"default"``: no ``--model``)."""
    cli = [sys.executable, "-m", "velox_mlx_lm.cli"]
    chosen = [] if model == "default" else ["--model", model]
    return [*cli, *chosen, *ISSUE_ARGS, "--max-tokens", str(max_tokens)]


def stacks(pid: int) -> str:
    """Every thread's backtrace of ``pid``, from gdb (empty without gdb)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return ""
    out = subprocess.run(
        [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    return "\n".join(ln for ln in out.splitlines() if ln.startswith(("Thread ", "#")))


def run_once(model: str, args: argparse.Namespace) -> Outcome:
    """Start the command, wait for its report, then give it ``args.grace`` seconds to exit."""
    outcome = Outcome(model)
    began = time.monotonic()
    process = subprocess.Popen(
        command(model, args.max_tokens),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    watch = _Watch(process)
    threading.Thread(target=watch.read, daemon=True).start()
    watch.done.wait(args.report_timeout)
    if watch.at is not None:
        outcome.report_s = watch.at - began
        left = max(0.0, watch.at + args.grace - time.monotonic())
        try:
            outcome.returncode = process.wait(timeout=left)
            outcome.exit_after_report_s = time.monotonic() - watch.at
        except subprocess.TimeoutExpired:
            if args.gdb:
                outcome.stacks = stacks(process.pid)
    if process.poll() is None:
        process.kill()
    process.wait()
    return outcome


def summary(outcomes: Sequence[Outcome], grace: float) -> list[str]:
    """One line per model: how many runs exited within ``grace`` seconds of their report."""
    lines = []
    for model in dict.fromkeys(o.model for o in outcomes):
        mine = [o for o in outcomes if o.model == model]
        exited = [o for o in mine if o.verdict == "exited"]
        waits = [o.exit_after_report_s for o in exited if o.exit_after_report_s is not None]
        tail = f", exit after report median {statistics.median(waits):.2f} s" if waits else ""
        tail += f", max {max(waits):.2f} s" if waits else ""
        hung = sum(o.verdict == "hung" for o in mine)
        lines.append(
            f"{model}: {len(exited)}/{len(mine)} exited within {grace:g} s of the report, "
            f"{hung} hung, {len(mine) - len(exited) - hung} other{tail}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20, help="runs in all, models alternating")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds from the report to the exit"
    )
    parser.add_argument("--report-timeout", type=float, default=600.0)
    parser.add_argument("--gdb", action="store_true", help="print a hung run's stacks")
    args = parser.parse_args(argv)
    outcomes = []
    for i in range(args.runs):
        outcome = run_once(args.models[i % len(args.models)], args)
        outcomes.append(outcome)
        report = "-" if outcome.report_s is None else f"{outcome.report_s:.1f} s"
        after = outcome.exit_after_report_s
        exit_text = "-" if after is None else f"{after:.2f} s"
        print(
            f"run {i + 1:3d} {outcome.model:24s} report {report:>8s}  "
            f"exit after report {exit_text:>8s}  {outcome.verdict}",
            flush=True,
        )
        if outcome.stacks:
            print(outcome.stacks, flush=True)
    print("\n".join(summary(outcomes, args.grace)))
    return 0 if all(o.verdict == "exited" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
