"""Load on ``velox-serve`` (issue 14): N concurrent conversations of growing length against a
server with TOVA(512) and against one with mlx-lm's full cache, one after the other in one run.

Each conversation sends ``turns`` streaming chat turns whose prompts grow linearly from
``start_tokens`` (below the budget: no eviction) to ``end_tokens``, greedy, ``gen_tokens`` each,
the previous turns reused from the server's prompt cache (``velox_bench.serve_bench`` says how
the load is made and measured). Reports per turn the aggregate decode tokens/s, TTFT and
inter-token latency p50/p95, and over time the server's RSS, MLX active memory and the live
sequences' KV bytes; writes ``benchmarks/results/serve.json`` and
``benchmarks/figures/serve.png``, with the issue's goals measured (not asserted).

Environment: ``VELOX_BENCH_SERVE_CONVERSATIONS`` (default 4), ``VELOX_BENCH_SERVE_TURNS`` (5),
``VELOX_BENCH_SERVE_START`` (400), ``VELOX_BENCH_SERVE_END`` (6000), ``VELOX_BENCH_SERVE_GEN``
(32). ``VELOX_BENCH_SMOKE=1``: 2 conversations, 2 short turns, budget 64, 4 tokens.
"""

from __future__ import annotations

import os

from velox_bench.results import SuiteResults, blas_report, figures_dirs, smoke
from velox_bench.serve_bench import LoadSpec, goals, plot_serve, run_load, spec_dict, summarize
from velox_bench.serve_bench import table as serve_table

SMOKE = smoke()
BUDGET = 64 if SMOKE else 512


def _env(name: str, default: int) -> int:
    return int(os.environ.get(f"VELOX_BENCH_SERVE_{name}", default))


SPEC = (
    LoadSpec(conversations=2, turns=2, start_tokens=40, end_tokens=120, gen_tokens=4)
    if SMOKE
    else LoadSpec(
        conversations=_env("CONVERSATIONS", 4),
        turns=_env("TURNS", 5),
        start_tokens=_env("START", 400),
        end_tokens=_env("END", 6000),
        gen_tokens=_env("GEN", 32),
    )
)
VELOX = f"tova({BUDGET})"
METHODS = {VELOX: ["--method", "tova", "--budget", str(BUDGET)], "full": ["--method", "full"]}


def test_serve_load(embedded_model: None) -> None:
    results = SuiteResults("serve")
    results.settings.update(
        spec=spec_dict(SPEC),
        budget=BUDGET,
        methods=METHODS,
        server="velox-serve (mlx-lm's server, BatchGenerator), the embedded SmolLM2-135M float32",
        load=(
            "one thread per conversation, streaming chat turns over HTTP, greedy; each turn's "
            "prompt = the conversation so far + a new user message; stats polled every "
            f"{SPEC.poll_s} s"
        ),
    )
    runs, summaries = {}, {}
    for label, flags in METHODS.items():
        run = run_load([*flags, "--max-tokens", str(SPEC.gen_tokens)], SPEC)
        runs[label] = run
        summaries[label] = summarize(run)
        assert len(run["requests"]) == SPEC.conversations * SPEC.turns
        for r in run["requests"]:
            results.add(method=label, **r)
    assert summaries[VELOX]["max_tokens_kept"] <= BUDGET
    results.summary = {"methods": summaries, "goals": goals(summaries, VELOX, "full")}
    results.settings["timelines"] = {label: run["timeline"] for label, run in runs.items()}
    path = results.write(blas_report())
    figures = plot_serve(
        {"runs": runs, "spec": spec_dict(SPEC)}, [d / "serve.png" for d in figures_dirs()]
    )
    print()
    print(serve_table(summaries))
    print(results.summary["goals"])
    print(f"velox-bench: wrote {path}, {', '.join(str(f) for f in figures)}")
