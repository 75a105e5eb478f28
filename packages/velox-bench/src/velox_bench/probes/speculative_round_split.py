"""Where a speculative round's time goes, Velox against the full cache: draft, verify (host and
evaluation apart) and trims.

    python -m velox_bench.probes.speculative_round_split [--draft 8] [--rounds 40] [--reps 2]
        [--methods tova]

The setting of ``velox_bench.probes.speculative_compare`` (the embedded model, a self-draft of
its first ``--draft`` layers, 3 draft tokens, the 571-token prompt, budget 256 with a 16-token
undo log), but every round is the same work for every cache: the draft proposes 3 tokens (one
``async_eval``'d step each, as mlx-lm's ``speculative_generate_step``), the target verifies
the 4-token chunk, and all 3 draft tokens are taken back (the target trims 3, the draft 2: the
round after a rejection at the first token, the common one with a truncated draft). The
target's first token starts the next round. So the times do not depend on how often a cache's
tokens match the draft's.

Per round, medians over ``--rounds`` rounds (the first 5 untimed), per method, in ms:

- draft: the 3 draft steps built and evaluated;
- verify host: the target's forward over the chunk, before anything is evaluated;
- verify eval: ``mx.eval`` of its tokens;
- trim: both trims (host; the rows they put back are evaluated with the next round);
- round: all of it.

Methods run in turn, ``--reps`` times (drifts hit every method alike); each rep's median is
printed, and the ratio of the reps' mean to the full cache's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import trim_prompt_cache  # noqa: E402

from velox_bench.probes.speculative_compare import BUDGET, NUM_DRAFT, config, setting  # noqa: E402
from velox_mlx_lm import KVCacheBuilder  # noqa: E402
from velox_mlx_lm.embedded import draft_of  # noqa: E402

PARTS = ("draft", "verify host", "verify eval", "trim", "round")
WARMUP, CHUNK = 5, 256


def _greedy(model: Any, caches: list[Any], tokens: mx.array) -> mx.array:
    """``tokens [L]`` through ``model``: the greedy next token after each, ``[L]``."""
    return mx.argmax(model(tokens[None], cache=caches)[0], axis=-1)


def _prefilled(model: Any, method: str, prompt: mx.array) -> list[Any]:
    caches = KVCacheBuilder.for_model(model, config(method))
    for start in range(0, int(prompt.size), CHUNK):
        model(prompt[None, start : start + CHUNK], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def _rounds(model: Any, draft: Any, method: str, prompt: mx.array, n: int) -> dict[str, float]:
    """Median ms per part over ``n`` timed rounds of one method."""
    target_caches = _prefilled(model, method, prompt[:-1])
    draft_caches = _prefilled(draft, method, prompt[:-1])
    y = prompt[-1:]
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(WARMUP + n):
        t0 = time.perf_counter()
        proposed, token = [], y
        for _ in range(NUM_DRAFT):
            token = _greedy(draft, draft_caches, token)[-1:]
            mx.async_eval(token)
            proposed.append(token)
        drafted = mx.concatenate(proposed)
        mx.eval(drafted)
        t1 = time.perf_counter()
        verified = _greedy(model, target_caches, mx.concatenate([y, drafted]))
        t2 = time.perf_counter()
        mx.eval(verified)
        t3 = time.perf_counter()
        trim_prompt_cache(target_caches, NUM_DRAFT)
        trim_prompt_cache(draft_caches, NUM_DRAFT - 1)
        t4 = time.perf_counter()
        y = verified[:1]
        if i >= WARMUP:
            spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)
            for part, seconds in zip(PARTS, spans, strict=True):
                times[part].append(seconds)
    return {part: statistics.median(times[part]) * 1e3 for part in PARTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--draft", type=int, default=8, help="draft layers")
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per rep")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--methods", default="tova", help="Velox methods, comma-separated")
    args = parser.parse_args(argv)
    model, prompt = setting()
    draft = draft_of(model, args.draft)
    methods = ["full", *args.methods.split(",")]
    reps: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for _ in range(args.reps):
        for method in methods:
            reps[method].append(_rounds(model, draft, method, prompt, args.rounds))
    print(
        f"BLAS: {BLAS}; draft {args.draft} layers, {NUM_DRAFT} draft tokens, budget {BUDGET}; "
        f"ms per round (median of {args.rounds}), one column per rep"
    )
    _print_table(reps)
    return 0


def _print_table(reps: dict[str, list[dict[str, float]]]) -> None:
    """One row per method (each rep's ms per part), and its ratios to the full cache's mean."""
    print(f"{'method':<10} " + " ".join(f"{p:>16}" for p in PARTS))
    mean = {m: {p: statistics.fmean(r[p] for r in rs) for p in PARTS} for m, rs in reps.items()}
    for method, rs in reps.items():
        cells = ["/".join(f"{r[p]:.2f}" for r in rs) for p in PARTS]
        print(f"{method:<10} " + " ".join(f"{c:>16}" for c in cells))
        if method != "full":
            ratios = [f"{mean[method][p] / mean['full'][p]:.2f}x" for p in PARTS]
            print(f"{'  vs full':<10} " + " ".join(f"{c:>16}" for c in ratios))


if __name__ == "__main__":
    raise SystemExit(main())
