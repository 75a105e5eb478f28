"""A batch of sequences' decode step on the embedded model: batched Velox caches beside mlx-lm's.

Each row's prompt (random token ids, lengths spread around ``--prompt``) is fed alone into a
single-sequence cache; the rows are then merged per layer as ``BatchGenerator`` merges them
(``KVCache.merge`` -> ``BatchKVCache`` for the full cache, ``merge`` -> a batched Velox cache)
and decode greedily, ``B`` tokens per step, in alternating rounds. Medians and the median of
per-round ratios are printed. This is the step behind ``velox-serve``'s throughput goals
without the server around it.

    python -m velox_bench.probes.batch_decode_step [--rows 4] [--prompt 416] [--method tova]
        [--budget 512]
"""

from __future__ import annotations

import argparse
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()  # before mlx is imported

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from velox_bench.probes.single_sequence_step import add_run_arguments, alternate, report  # noqa: E402
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402


def merged(model: Any, make: Any, prompts: list[mx.array]) -> list[Any]:
    """Per-layer batched caches of ``prompts``, each prefilled alone then merged."""
    rows = []
    for prompt in prompts:
        caches = make()
        mx.eval(model(prompt[None], cache=caches), [c.state for c in caches])
        rows.append(caches)
    return [type(rows[0][i]).merge([r[i] for r in rows]) for i in range(len(rows[0]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--prompt", type=int, default=416, help="mean prompt tokens")
    add_run_arguments(parser)
    args = parser.parse_args()
    model = load_default()[0]
    lengths = [args.prompt + 16 * (i - args.rows // 2) for i in range(args.rows)]
    prompts = [
        mx.random.randint(0, 2000, (n,), key=mx.random.key(i)) for i, n in enumerate(lengths)
    ]
    policy = KVCacheConfig(method=args.method).policy
    config = KVCacheConfig(method=args.method, **{f"{policy}_budget": args.budget})
    lists: dict[str, Any] = {
        "full": merged(model, lambda: make_prompt_cache(model), prompts),
        args.method: merged(model, lambda: KVCacheBuilder.for_model(model, config), prompts),
    }
    state = {name: mx.zeros((args.rows, 1), dtype=mx.int32) for name in lists}
    times = alternate(model, lists, state, args.rounds, args.steps)
    print(
        f"BLAS: {BLAS}; {args.rows} rows, prompts {lengths}, "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    ratio = report(times, args.method)
    print(f"(step time; throughput ratio {1 / ratio:.2f})")


if __name__ == "__main__":
    main()
