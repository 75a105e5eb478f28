"""Processes that loaded OpenBLAS through ``velox_blas`` exit once they are done (issue 50).

``velox-generate --json`` printed its report and sometimes never exited: OpenBLAS's destructor
ran during ``exit()`` while MLX's stream thread was still inside a multithreaded BLAS call (the
decode step mlx-lm evaluates ahead), and joined a worker that had missed its stop signal.
``velox_blas`` now waits for MLX and stops the pool itself, from an ``atexit`` handler.

Each test runs a fresh interpreter (the preload must come before ``mlx`` is imported, and the
bug lives in process exit) and measures from the line it prints last to its exit. The bound is
generous (``GRACE``) so a slow machine never fails it; before the fix, the in-flight cases hung
for good, nearly every time, on a 2-core machine. Without OpenBLAS the same processes run on the
reference BLAS and must exit just the same. ``python -m velox_bench.exit_check`` repeats the
issue's own command many times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

GRACE = 30.0  # seconds from the last line printed to the exit

# MLX's CPU stream thread is given about a second of float32 matmuls (multithreaded in
# OpenBLAS) and the process exits without waiting for them, as velox-generate did.
IN_FLIGHT = """
import sys
import velox_blas
velox_blas.preload_openblas()
import mlx.core as mx
if sys.argv[1] == "generation":
    from mlx_lm.generate import generation_stream as stream
else:
    stream = mx.default_stream(mx.cpu)
a = mx.full((64, 512), 0.5)
w = mx.full((512, 4096), 0.25)
mx.eval(a, w)
with mx.stream(stream):
    outs = [a @ w + i for i in range(50)]
mx.async_eval(outs)
print("DONE", flush=True)
"""

SHUTDOWN = """
import velox_blas
decision = velox_blas.preload_openblas()
import mlx.core as mx
a = mx.full((256, 256), 0.5)
mx.eval(a @ a)
first = velox_blas.shutdown_openblas()
after = (a @ a).tolist()  # single-threaded now, still right
second = velox_blas.shutdown_openblas()
assert all(v == 64.0 for row in after for v in row)
print(decision)
print(first, second)
print("END", flush=True)
"""


def _env() -> dict[str, str]:
    """This environment, with the preload on, no LD_PRELOAD choosing the BLAS instead, and
    OpenBLAS's own thread count (``nox -s tests`` sets one thread a process; the hang needs
    several)."""
    drop = {
        "VELOX_BLAS",
        "LD_PRELOAD",
        "OPENBLAS_NUM_THREADS",
        "GOTO_NUM_THREADS",
        "OMP_NUM_THREADS",
    }
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_until_exit(argv: list[str], last_line: str, limit: float = 600.0) -> tuple[str, float]:
    """Run ``argv``; its stdout, and the seconds from ``last_line`` to the exit.

    Fails when the line never comes within ``limit`` seconds, or the process is still running
    ``GRACE`` seconds after it (then it is killed).
    """
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    lines: list[str] = []
    seen = threading.Event()
    at: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if line.rstrip("\n") == last_line and not at:
                at.append(time.monotonic())
                seen.set()
        seen.set()

    errors: list[str] = []
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert process.stderr is not None
    drain = threading.Thread(target=lambda: errors.extend(process.stderr or []), daemon=True)
    drain.start()
    try:
        seen.wait(limit)
        assert at, f"no {last_line!r} line; stderr:\n{''.join(errors)[-3000:]}"
        try:
            code = process.wait(timeout=max(0.0, at[0] + GRACE - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {GRACE:g} s after printing {last_line!r} (issue 50)")
        waited = time.monotonic() - at[0]
        reader.join(10)
        drain.join(10)
        assert code == 0, "".join(errors)[-3000:]
        return "".join(lines), waited
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["default", "generation"])
def test_exit_with_blas_work_in_flight(stream: str) -> None:
    """Matmuls still running on MLX's stream thread (the default CPU stream, or mlx-lm's
    ``generation_stream``) when the interpreter exits."""
    out, _ = run_until_exit([sys.executable, "-c", IN_FLIGHT, stream], "DONE")
    assert out.splitlines()[-1] == "DONE"


def test_shutdown_openblas_stops_the_pool_once_and_blas_still_works() -> None:
    out, _ = run_until_exit([sys.executable, "-c", SHUTDOWN], "END", limit=300)
    decision, result, _ = out.splitlines()[-3:]
    assert result == ("True True" if decision.startswith("OpenBLAS (/") else "False False")


def test_shutdown_openblas_without_a_loaded_openblas_does_nothing() -> None:
    code = "import velox_blas\nprint(velox_blas.shutdown_openblas(), flush=True)\n"
    out, _ = run_until_exit([sys.executable, "-c", code], "False", limit=120)
    assert out.splitlines()[-1] == "False"


@pytest.mark.slow
@pytest.mark.model
def test_velox_generate_exits_after_its_report(embedded_model_path: object) -> None:
    """The issue's command on the default model (SmolLM2), two tokens: the JSON report, then
    the exit."""
    argv = [sys.executable, "-m", "velox_mlx_lm.cli", "--method", "tova", "--budget", "128"]
    argv += ["--prompt", "The capital of France is", "--max-tokens", "2", "--json"]
    out, _ = run_until_exit(argv, "}")
    report = json.loads(out)
    assert report["blas"] and report["runs"][0]["generated_tokens"] >= 1
