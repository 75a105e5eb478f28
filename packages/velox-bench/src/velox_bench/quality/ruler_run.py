"""Run the RULER-style tasks (:mod:`velox_bench.quality.ruler`) on a model with Velox caches.

Each task is answered greedily, once per cache variant and budget: a chat model through its
chat template, a base model (Gemma 3 270M) on the plain prompt; either way the task's primer
starts the answer. ``evaluate`` returns one row per task sample, method and budget, with the
model's name; ``nox -s bench -- ruler`` runs the full grid (``benchmarks/test_ruler.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from velox_bench.quality.retrieval import has_chat_template
from velox_bench.quality.ruler import KINDS, LENGTHS, Task, make_task, score
from velox_bench.variants import Variant
from velox_mlx_lm import KVCacheBuilder

__all__ = ["Grid", "answer", "encoder", "evaluate", "prompt_ids", "row_key"]

MAX_TOKENS = {"multikey": 16, "multivalue": 48, "variable_tracking": 32, "common_words": 64}


@dataclass(frozen=True)
class Grid:
    """What one run covers: tasks x lengths x samples, each under every (variant, budget)."""

    kinds: Sequence[str] = KINDS
    lengths: Sequence[int] = LENGTHS
    samples: int = 5
    runs: Sequence[tuple[Variant, int]] = ()  # (variant, budget); budget 0 for the full cache
    max_tokens: int | None = None  # tokens generated per answer; None: MAX_TOKENS per task


def prompt_ids(tokenizer: Any, task: Task) -> list[int]:
    """The task's tokens: through the chat template when the tokenizer has one, then the
    primer; otherwise the plain prompt (BOS as the tokenizer adds it)."""
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": f"{task.context}\n\n{task.question}"}]
        head = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        return head + list(tokenizer.encode(task.primer, add_special_tokens=False))
    return list(tokenizer.encode(task.prompt()))


def answer(model: Any, tokenizer: Any, task: Task, config: Any, max_tokens: int) -> str:
    """The model's greedy continuation of the task's prompt under ``config``'s caches."""
    import mlx_lm

    caches = KVCacheBuilder.for_model(model, config)
    return str(
        mlx_lm.generate(
            model,
            tokenizer,
            prompt_ids(tokenizer, task),
            max_tokens=max_tokens,
            prompt_cache=caches,
            prefill_step_size=512,
        )
    )


Key = tuple[str, str, int, int, str, int | None]  # model, task, length, seed, method, budget


def row_key(row: dict[str, Any]) -> Key:
    """What identifies a row of the grid, so that a resumed run skips it."""
    return (row["model"], row["task"], row["length"], row["seed"], row["method"], row["budget"])


def evaluate(
    models: Sequence[tuple[str, Any, Any]],
    grid: Grid,
    done: Container[Key] = (),
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (model, task, length, sample, variant, budget): the score and the output.

    ``models`` holds (name, model, tokenizer). Samples are the outer loop, then lengths, tasks
    and models, so that a run cut short has every cell of the first samples for both models.
    Rows whose :func:`row_key` is in ``done`` are skipped; ``on_row`` sees each new row as soon
    as it exists (to append it to a file). A tqdm bar counts prompt tokens.
    """
    from tqdm import tqdm  # type: ignore[import-untyped]

    cells = list(itertools.product(range(grid.samples), grid.lengths, grid.kinds, models))
    todo = sum(
        length
        for seed, length, kind, (name, _, _) in cells
        for variant, budget in grid.runs
        if (name, kind, length, seed, variant.name, budget or None) not in done
    )
    rows = []
    with tqdm(total=todo, unit="tok", desc="ruler", smoothing=0.05) as bar:
        for seed, length, kind, (name, model, tokenizer) in cells:
            task = make_task(kind, length, seed, encoder(tokenizer))
            n_prompt = len(prompt_ids(tokenizer, task))
            for variant, budget in grid.runs:
                if (name, kind, length, seed, variant.name, budget or None) in done:
                    continue
                start = time.perf_counter()
                tokens = grid.max_tokens or MAX_TOKENS[kind]
                output = answer(model, tokenizer, task, variant.config(budget), tokens)
                row = {
                    "model": name,
                    "task": kind,
                    "length": length,
                    "prompt_tokens": n_prompt,
                    "seed": seed,
                    "method": variant.name,
                    "budget": budget or None,
                    "score": score(task, output),
                    "output": output,
                    "seconds": round(time.perf_counter() - start, 2),
                }
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                bar.update(length)
    return rows


def encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    return encode
