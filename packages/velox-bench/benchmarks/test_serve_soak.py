"""Soak on ``velox-serve`` (issue 33, point 5): agent-style conversations that grow past the
embedded model's 8k context with ``--beyond-context``, against mlx-lm's full cache up to its
context, one server after the other.

Each conversation adds ``TURN`` tokens of tool output per turn and streams a ``GEN``-token
reply, until its prompt passes ``TARGET`` tokens (the full cache stops before its context);
no turn starts after ``MAX_S`` seconds of a run (``velox_bench.serve_soak`` says how the load
is made and measured). Asserted on the bounded server: no request lost or refused, every
conversation past ``TARGET`` and past the context, at most the budget kept, and the most RSS
after warm-up (every conversation done with ``WARMUP`` turns) within 5% of the most during it
(peak against peak: both include prefill activations; ``serve_soak.rss_after_warmup``).
Reported for both: p50/p99 inter-token latency (the bounded server's also over its turns
within the context), TTFT and RSS over time. Writes ``benchmarks/results/serve_soak.json``.

Environment ``VELOX_BENCH_SOAK_<NAME>``: ``CONVERSATIONS`` (4), ``TURN`` (1500), ``TARGET``
(12288), ``GEN`` (32), ``MAX_S`` (1800, per server), ``WARMUP`` (2), ``METHOD`` (tova),
``BUDGET`` (512). ``VELOX_BENCH_SMOKE=1``: 2 conversations on a server whose context is
lowered to 160 tokens, budget 32, 70-token turns to 400 tokens, 4 tokens each; the RSS bound
is reported, not asserted (a run of seconds has no steady state).
"""

from __future__ import annotations

import os

from velox_bench.results import SuiteResults, blas_report, smoke
from velox_bench.serve_soak import SoakSpec, run_soak, spec_dict, summarize_soak, table

SMOKE = smoke()
RSS_GROWTH_LIMIT = 0.05


def _env(name: str, default: str) -> str:
    return os.environ.get(f"VELOX_BENCH_SOAK_{name}", default)


METHOD = _env("METHOD", "tova")
BUDGET = 32 if SMOKE else int(_env("BUDGET", "512"))
LOWERED_CONTEXT = 160 if SMOKE else None
SPEC = (
    SoakSpec(
        conversations=2,
        turn_tokens=70,
        target_tokens=400,
        gen_tokens=4,
        context=160,
        max_s=300,
        warmup_turns=1,
        poll_s=0.25,
    )
    if SMOKE
    else SoakSpec(
        conversations=int(_env("CONVERSATIONS", "4")),
        turn_tokens=int(_env("TURN", "1500")),
        target_tokens=int(_env("TARGET", "12288")),
        gen_tokens=int(_env("GEN", "32")),
        max_s=float(_env("MAX_S", "1800")),
        warmup_turns=int(_env("WARMUP", "2")),
    )
)
BOUNDED = f"{METHOD}({BUDGET})"
FLAGS = ["--max-tokens", str(SPEC.gen_tokens)]
METHODS = {
    # at the smoke's budget of 32 the system prompt (~28 tokens) cannot be pinned: pin nothing
    BOUNDED: [
        *("--method", METHOD, "--budget", str(BUDGET), "--beyond-context", *FLAGS),
        *(("--max-pinned", "0") if SMOKE else ()),
    ],
    "full": ["--method", "full", *FLAGS],
}


def test_serve_soak(embedded_model: None) -> None:
    results = SuiteResults("serve_soak")
    results.settings.update(
        spec=spec_dict(SPEC),
        budget=BUDGET,
        methods=METHODS,
        lowered_context=LOWERED_CONTEXT,
        rss_growth_limit=RSS_GROWTH_LIMIT,
        server="velox-serve, the embedded SmolLM2-135M float32 (context 8192)",
        load=(
            "one thread per conversation, not synchronised; a system prompt, then turns of "
            f"{SPEC.turn_tokens} tokens of tool output + an instruction, streamed greedy "
            f"replies of {SPEC.gen_tokens} tokens, the conversation so far resent each turn; "
            f"stats polled every {SPEC.poll_s} s"
        ),
    )
    runs, summaries = {}, {}
    for label, flags in METHODS.items():
        stay_in_context = label == "full"
        run = run_soak(flags, SPEC, stay_in_context, LOWERED_CONTEXT)
        runs[label] = run
        summaries[label] = summarize_soak(run, SPEC)
        for r in run["requests"]:
            results.add(method=label, **r)
    results.summary = {"methods": summaries}
    results.settings["timelines"] = {label: run["timeline"] for label, run in runs.items()}
    path = results.write(blas_report())
    print()
    print(table(summaries))
    print(f"velox-bench: wrote {path}")
    for label, s in summaries.items():
        assert s["lost"] == 0, f"{label}: {s['lost']} requests lost"
        assert s["refused"] == 0, f"{label}: {s['refused']} requests refused"
    bounded = summaries[BOUNDED]
    assert min(bounded["max_prompt_tokens_per_conversation"]) > SPEC.target_tokens, (
        f"a conversation stopped before {SPEC.target_tokens} tokens (MAX_S {SPEC.max_s} s?)"
    )
    assert min(bounded["max_prompt_tokens_per_conversation"]) > SPEC.context
    assert max(summaries["full"]["max_prompt_tokens_per_conversation"]) <= SPEC.context
    assert bounded["max_tokens_kept"] <= BUDGET
    if not SMOKE:
        growth = bounded["rss"]["growth"]
        assert growth is not None, "no RSS sample after warm-up"
        assert growth <= RSS_GROWTH_LIMIT, f"peak RSS grew {100 * growth:.1f}% after warm-up"
