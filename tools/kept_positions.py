"""Print which prompt positions each policy keeps on the embedded model (layer 0, KV head 0).

    python tools/kept_positions.py [--budget 32] [--tokens 160]

The prompt is the first ``--tokens`` tokens of the shipped English paragraph, fed the way
mlx-lm's generate_step feeds a prompt (chunks, then the last token alone).
"""

from __future__ import annotations

import argparse

# velox_bench.blas loads OpenBLAS before anything imports mlx (importing velox_mlx_lm would).
from velox_bench.blas import preload

BLAS = preload()

import mlx.core as mx  # noqa: E402

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default, paragraph  # noqa: E402

METHODS = ["tova", "tova_adapted", "h2o", "streaming_llm", "snapkv", "morphkv"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=160)
    args = parser.parse_args()
    model, tokenizer = load_default()
    tokens = mx.array(tokenizer.encode(paragraph())[: args.tokens])[None]
    print(f"BLAS: {BLAS}; prompt: {tokens.shape[1]} tokens; budget {args.budget}")
    for method in METHODS:
        fields = {f"{method.removesuffix('_adapted')}_budget": args.budget}
        if method == "snapkv":
            fields["snapkv_window"] = 8
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **fields))
        n = tokens.shape[1]
        for start in range(0, n - 1, 64):
            model(tokens[:, start : min(start + 64, n - 1)], cache=caches)
        model(tokens[:, n - 1 :], cache=caches)
        positions = sorted(caches[0].positions[0, 0].tolist())
        print(f"{method:>14}: {positions}")


if __name__ == "__main__":
    main()
