"""``velox-generate`` with several prompts: one batch through mlx-lm's ``BatchGenerator``.

Every prompt gets its own row of the batched Velox caches (``velox_mlx_lm.batch_cache``), so
each answer is the one the prompt gets alone; the batch shares the model's forward passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from velox_mlx_lm.cli.generation import cell, grid, kv_stats, quant_stats, quantized
from velox_mlx_lm.pins import pin_prefix


@dataclass
class BatchRun:
    """One method's batch: per-prompt answers and stats, and the batch's own stats."""

    label: str
    answers: list[str]
    stats: list[dict[str, Any]]
    batch: dict[str, Any] = field(default_factory=dict)


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    config: Any,
    args: argparse.Namespace,
    label: str,
) -> BatchRun:
    """Generate every prompt in one batch with caches built from ``config``."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler
    from tqdm import tqdm  # type: ignore[import-untyped]

    from velox_mlx_lm.builder import KVCacheBuilder

    mx.random.seed(args.seed)
    mx.reset_peak_memory()
    had_own = "make_cache" in vars(model)
    own = vars(model).get("make_cache")
    model.make_cache = lambda: pin_prefix(KVCacheBuilder.for_model(model, config), args.pin_prefix)
    gen = BatchGenerator(
        model,
        max_tokens=args.max_tokens,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        sampler=make_sampler(temp=args.temp),
        prefill_step_size=args.prefill_step_size,
    )
    tokens: dict[int, list[int]] = {}
    caches: dict[int, list[Any]] = {}
    steps: dict[int, int] = {}  # responses per sequence (a stop token is one, not appended)
    bar = tqdm(
        total=len(prompts) * args.max_tokens,
        desc=f"batch of {len(prompts)} ({label})",
        unit="tok",
        file=sys.stderr,
        disable=args.json,
        leave=False,
    )
    try:
        uids = gen.insert(prompts, [args.max_tokens] * len(prompts))
        tokens = {uid: [] for uid in uids}
        steps = dict.fromkeys(uids, 0)
        with gen.stats() as stats:
            while responses := gen.next_generated():
                for r in responses:
                    steps[r.uid] += 1
                    bar.update(1)
                    if r.finish_reason != "stop":
                        tokens[r.uid].append(r.token)
                    if r.finish_reason is not None:
                        caches[r.uid] = r.prompt_cache
                        bar.update(args.max_tokens - steps[r.uid])
    finally:
        bar.close()
        gen.close()
        if had_own:
            model.make_cache = own
        else:
            del model.make_cache
    per_prompt = [
        {
            "prompt_tokens": len(prompt),
            "generated_tokens": len(tokens[uid]),
            **kv_stats(caches[uid]),
        }
        for uid, prompt in zip(uids, prompts, strict=True)
    ]
    batch = {
        "sequences": len(prompts),
        "prefill_tokens_per_s": round(stats.prompt_tps, 2),
        "decode_tokens_per_s": round(stats.generation_tps, 2),
        "kv_bytes": sum(s["kv_bytes"] for s in per_prompt),
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        **quant_stats(config),
    }
    answers = [_detokenize(tokenizer, tokens[uid]) for uid in uids]
    return BatchRun(label, answers, per_prompt, batch)


def _detokenize(tokenizer: Any, tokens: list[int]) -> str:
    """The text ``stream_generate`` would print for ``tokens`` (its streaming detokenizer
    drops a leading space that ``decode`` keeps)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return str(detokenizer.text)


def print_batch(
    runs: list[BatchRun],
    model_name: str,
    blas: str,
    config: Any,
    seconds: float,
    args: argparse.Namespace,
) -> None:
    """Per-prompt answers and stats (one table per method), then the batches' stats."""

    if args.json:
        out = {
            "model": model_name,
            "blas": blas,
            "config": {"method": config.method, **config.settings(), **quantized(config)},
            "runs": [
                {
                    "label": r.label,
                    **r.batch,
                    "prompts": [
                        {"answer": a, **s} for a, s in zip(r.answers, r.stats, strict=True)
                    ],
                }
                for r in runs
            ],
            "seconds": round(seconds, 2),
        }
        print(json.dumps(out, indent=2))
        return
    n = len(runs[0].answers)
    print(f"model: {model_name}  |  BLAS: {blas}  |  {n} prompts in one batch")
    for i in range(n):
        for r in runs:
            print(f"\n=== prompt {i + 1} ({r.label}) ===\n{r.answers[i].strip()}")
    for r in runs:
        keys = list(r.stats[0])
        header = [f"#{i + 1}" for i in range(n)]
        print(f"\n{r.label}, per prompt:")
        print(grid(header, {k: [cell(s[k]) for s in r.stats] for k in keys}, min_width=12))
    print("\nbatch:")
    batch_keys = list(runs[0].batch)
    rows = {k: [cell(r.batch[k]) for r in runs] for k in batch_keys}
    print(grid([r.label for r in runs], rows, min_width=12))
    print(f"\ntotal time: {seconds:.1f} s")
