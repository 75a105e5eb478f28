"""Print which prompt positions each policy keeps on the embedded model (layer 0, KV head 0).

    python -m velox_bench.probes.kept_positions [--budget 64] [--tokens 160]
        [--set snapkv_window=8 ...]

Every registered method runs (``velox_bench.variants.policy_variants()``) with its defaults at
``--budget``; ``--set FIELD=VALUE`` changes any ``KVCacheConfig`` field (e.g. a smaller SnapKV
window for a budget of 32). The prompt is the first ``--tokens`` tokens of the shipped English
paragraph, fed the way mlx-lm's generate_step feeds a prompt (chunks, then the last token
alone).
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

# velox_blas loads OpenBLAS before anything imports mlx (it imports no mlx itself).
from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402

from velox_bench.variants import policy_variants  # noqa: E402
from velox_mlx_lm import KVCacheBuilder  # noqa: E402
from velox_mlx_lm.embedded import load_default, paragraph  # noqa: E402


def _field(text: str) -> tuple[str, Any]:
    """``FIELD=VALUE``; the value a Python literal where it parses as one, else a string."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument(
        "--set",
        type=_field,
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a KVCacheConfig field for every method, e.g. snapkv_window=8 (repeatable)",
    )
    args = parser.parse_args()
    changes = dict(args.set)
    model, tokenizer = load_default()
    tokens = mx.array(tokenizer.encode(paragraph())[: args.tokens])[None]
    print(f"BLAS: {BLAS}; prompt: {tokens.shape[1]} tokens; budget {args.budget}")
    for variant in policy_variants():
        caches = KVCacheBuilder.for_model(model, variant.config(args.budget, **changes))
        n = tokens.shape[1]
        for start in range(0, n - 1, 64):
            model(tokens[:, start : min(start + 64, n - 1)], cache=caches)
        model(tokens[:, n - 1 :], cache=caches)
        positions = sorted(caches[0].positions[0, 0].tolist())
        print(f"{variant.name:>14}: {positions}")


if __name__ == "__main__":
    main()
