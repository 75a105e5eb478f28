"""The long-context instrument: Qwen2.5-Coder-1.5B-Instruct, the grid that issue 48 asks for.

Cells, mandatory first (``plan``):

1. retrieval at 8k tokens for the full cache, tova, h2o, snapkv and kvzip at budget context/4:
   :data:`N_PER_DEPTH` facts planted around each depth (10%, 50%, 90%) of one real document,
   every question asked from a copy of the compressed state (copies merged into one batch);
2. streaming perplexity on real code (:mod:`.code_text`) at 4k for every method without a
   prompt end (SnapKV, Expected Attention and KVzip compress once at a prompt end, and
   streaming text has none);
3. then, as time allows: retrieval with Expected Attention at 8k, every published method
   (:data:`PUBLISHED`) at 16k, the RULER-style tasks at 4k and 8k (one seeded task of each
   kind per cell), retrieval at budget context/8, StreamingLLM and MorphKV, and perplexity
   to 8k.

Every finished cell appends one JSON line to the results file; a rerun skips the cells already
there, so the grid can be stopped and resumed across sessions (``python -m
velox_bench.instrument``). The machine-hours the chosen cells should take are printed first,
from the measured speed of the model on the 2-core machine (:data:`RATES`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from velox_bench.quality import corpus, methods, retrieval, ruler, ruler_run
from velox_bench.quality.checkpoint import Checkpoint, Saved
from velox_bench.quality.perplexity import perplexity, token_nll
from velox_bench.variants import Variant

__all__ = [
    "RATES",
    "Cell",
    "Fact",
    "KindLog",
    "estimate_hours",
    "many_facts",
    "plan",
    "retrieval_document",
    "run_cell",
]

DEPTHS = retrieval.DEPTHS
N_PER_DEPTH = 20
SPREAD = 0.04  # the facts of one depth sit within +-2% of the document around it
# Distinct keys for many facts in one document (retrieval.CITIES has 30).
CITIES = (*retrieval.CITIES, *(
    "Athens", "Prague", "Dakar", "Quito", "Hanoi", "Delhi", "Seoul", "Sydney", "Toronto",
    "Boise", "Tampa", "Omaha", "Phoenix", "Houston", "Atlanta", "Detroit", "Denmark", "Zurich",
    "Milan", "Turin", "Munich", "Hamburg", "Lyon", "Nice", "Porto", "Seville", "Valencia",
    "Bergen", "Krakow", "Riga", "Tallinn", "Helsinki", "Stockholm", "Bangkok", "Jakarta",
    "Lagos", "Accra", "Kampala", "Santiago", "Bogota", "Caracas", "Montreal", "Ottawa",
))  # fmt: skip
# Tokens a second on the 2-core machine (float32 weights, OpenBLAS), for the estimate only:
# measured prefill of 1,024 tokens and single-token steps (docs/benchmarks.md).
RATES = {"qwen2.5-coder-1.5b": (8.0, 0.7), "smollm2-135m": (100.0, 12.0)}
RETRIEVAL_METHODS = ("full", "tova", "h2o", "snapkv", "kvzip")
MORE_METHODS = ("expected_attention", "streaming_llm", "morphkv")
PUBLISHED = (*RETRIEVAL_METHODS, "expected_attention")  # the methods the issue publishes
RULER_LENGTHS = (4096, 8192)  # the RULER-style tasks, one seeded task of each kind per cell


class Fact(retrieval.Fact):
    """A fact stated once ("The pass key of Oslo is 48213."): many fit in one document."""

    def sentence(self) -> str:
        return f"The pass key of {self.city} is {self.number}."


def many_facts(n_per_depth: int, depths: Sequence[float] = DEPTHS, seed: int = 0) -> list[Fact]:
    """``n_per_depth * len(depths)`` facts with distinct keys and 5-digit numbers (fixed by
    ``seed``), depth by depth."""
    need = n_per_depth * len(depths)
    if not 1 <= need <= len(CITIES):
        raise ValueError(f"n_per_depth * depths must be in [1, {len(CITIES)}], got {need}")
    rng = random.Random(seed)
    cities = rng.sample(CITIES, need)
    return [Fact(city, rng.randrange(10_000, 100_000)) for city in cities]


def where(n_per_depth: int, depths: Sequence[float] = DEPTHS) -> list[float]:
    """Relative positions of :func:`many_facts`: spread evenly over :data:`SPREAD` around
    each depth, clipped into the document."""
    out = []
    for depth in depths:
        for i in range(n_per_depth):
            offset = (i - (n_per_depth - 1) / 2) * SPREAD / max(n_per_depth, 1)
            out.append(min(max(depth + offset, 0.0), 1.0))
    return out


def retrieval_document(n_tokens: int, encode: Callable[[str], list[int]]) -> str:
    """The most recent addresses, oldest first, joined and cut to whole sentences within
    ``n_tokens`` (one address holds about 8k tokens; 16k needs two or three)."""
    texts: list[str] = []
    for speech in reversed(corpus.speeches()):
        texts.insert(0, speech.text().strip())
        if len(encode("\n\n".join(texts))) >= n_tokens:
            break
    return retrieval.cut_document("\n\n".join(texts), n_tokens, encode)


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a task at a length, one method at one budget (0: full cache)."""

    task: str  # "retrieval", "ruler", "ppl_code" or "ppl_prose"
    length: int  # tokens of context
    method: str
    budget: int
    kv_bits: int = 0  # quantized main rows (keys per channel; 0: the model's precision)
    demote_bits: int = 0  # a demoted tier (issue 49) of demote_budget rows (0: none)
    demote_budget: int = 0

    def key(self) -> str:
        key = f"{self.task}/{self.length}/{self.method}/{self.budget}"
        if self.kv_bits:
            key += f"/kv{self.kv_bits}"
        if self.demote_bits:
            key += f"/d{self.demote_bits}x{self.demote_budget}"
        return key

    def config(self) -> Any:
        """The cell's ``KVCacheConfig``."""
        config = _variant(self.method).config(max(self.budget, 1))
        if self.kv_bits:
            config = config.replace(kv_bits=self.kv_bits, kv_key_layout="channel")
        if self.demote_bits:
            config = config.replace(demote_bits=self.demote_bits, demote_budget=self.demote_budget)
        return config


# The instrument's KV rows: 2 KV heads of 128 float32 features (keys and values: 1,024 bytes).
HEAD_DIM, ITEMSIZE = 128, 4


def tier_cells(length: int = 8192, share: int = 8) -> list[Cell]:
    """Issue 49's comparison at the bytes of ``length / share`` full-precision rows: pure
    eviction at full precision and at 4 bits, and half the rows at full precision plus a
    demoted tier at 2 or 4 bits in the other half's bytes; retrieval at ``length``, and
    perplexity on ``length / 2`` tokens of code (beside the grid's full and TOVA cells there,
    whose budget is the same ``length / 8``)."""
    from velox_bench.quality.demote_tier import tier_rows
    from velox_bench.quality.per_byte import equal_bytes_budget

    budget = length // share
    half = budget // 2
    d2, d4 = (tier_rows(budget, half, bits, HEAD_DIM, ITEMSIZE) for bits in (2, 4))
    d2q = tier_rows(budget, budget - half // 2, 2, HEAD_DIM, ITEMSIZE)
    kv4 = equal_bytes_budget(budget, HEAD_DIM, ITEMSIZE, 4, "channel")
    return [
        Cell("retrieval", length, "tova", half, demote_bits=2, demote_budget=d2),
        Cell("retrieval", length, "tova", half, demote_bits=4, demote_budget=d4),
        Cell("retrieval", length, "tova", budget),
        Cell("retrieval", length, "tova", kv4, kv_bits=4),
        Cell("retrieval", length, "h2o", half, demote_bits=2, demote_budget=d2),
        Cell("retrieval", length, "snapkv", half, demote_bits=2, demote_budget=d2),
        # SnapKV's 2-bit tier kept 63% of the full cache at 10% depth: its 4-bit tier keeps
        # fewer rows at twice the bits
        Cell("retrieval", length, "snapkv", half, demote_bits=4, demote_budget=d4),
        # three quarters of the bytes in SnapKV's own rows, a 2-bit tier in the last quarter
        Cell("retrieval", length, "snapkv", budget - half // 2, demote_bits=2, demote_budget=d2q),
        # perplexity at the same bytes (the issue asks for it within 2% of the full cache),
        # on the code the grid's first perplexity cells read (full and tova/1024 are there)
        Cell("ppl_code", length // 2, "tova", half, demote_bits=4, demote_budget=d4),
        Cell("ppl_code", length // 2, "tova", half, demote_bits=2, demote_budget=d2),
    ]


def _budget(method: str, length: int, share: int) -> int:
    return 0 if method == "full" else length // share


def _ppl_methods() -> list[str]:
    excluded = methods.excluded_from_perplexity()
    return [m for m in (*RETRIEVAL_METHODS, *MORE_METHODS) if m not in excluded and m != "kvzip"]


def plan(quick: bool = False) -> list[Cell]:
    """Every cell in the order the issue ranks them: the mandatory ones first."""
    if quick:
        return [
            Cell("retrieval", 256, "full", 0),
            Cell("retrieval", 256, "tova", 64),
            Cell("ppl_code", 128, "full", 0),
            Cell("ppl_code", 128, "tova", 32),
            Cell("ruler", 512, "tova", 128),
        ]
    cells = [Cell("retrieval", 8192, m, _budget(m, 8192, 4)) for m in RETRIEVAL_METHODS]
    cells += [Cell("ppl_code", 4096, m, _budget(m, 4096, 4)) for m in _ppl_methods()]
    # the order: its sixth method, 16k, the RULER-style tasks, budget context/8, then
    # the methods "where time allows"
    cells += [Cell("retrieval", 8192, m, 8192 // 4) for m in MORE_METHODS[:1]]
    cells += tier_cells()  # issue 49's demoted tier at equal bytes
    cells += [Cell("retrieval", 16384, m, _budget(m, 16384, 4)) for m in PUBLISHED]
    cells += [Cell("ruler", n, m, _budget(m, n, 4)) for n in RULER_LENGTHS for m in PUBLISHED]
    cells += [Cell("retrieval", 8192, m, 8192 // 8) for m in RETRIEVAL_METHODS[1:]]
    cells += [Cell("retrieval", 8192, m, 8192 // 4) for m in MORE_METHODS[1:]]
    cells += [Cell("ppl_prose", 8192, m, _budget(m, 8192, 4)) for m in _ppl_methods()]
    cells += [Cell("ppl_code", 8192, m, _budget(m, 8192, 4)) for m in _ppl_methods()]
    return list({cell.key(): cell for cell in cells}.values())  # a cell twice: its first place


def estimate_hours(
    cells: Iterable[Cell],
    model: str,
    n_per_depth: int = N_PER_DEPTH,
    kinds: KindLog | None = None,
    saves: Callable[[str], Checkpoint] | None = None,
) -> float:
    """Machine-hours the cells should take at :data:`RATES` (prefill tokens, then the questions'
    batched answer steps; KVzip reads its document twice; a RULER-style cell's kinds already
    in ``kinds`` cost nothing, nor a retrieval cell's tokens already read in ``saves``)."""
    prefill, step = RATES.get(model, RATES["qwen2.5-coder-1.5b"])
    seconds = 0.0
    for cell in cells:
        passes = 2 if cell.method == "kvzip" else 1
        if cell.task == "ruler":  # one prompt per kind, then its answer's steps
            saved = kinds.saved(cell.key()) if kinds is not None else {}
            left = [k for k in ruler.KINDS if k not in saved]
            seconds += passes * len(left) * cell.length / prefill
            seconds += sum(ruler_run.MAX_TOKENS[k] for k in left) / step
            continue
        kept = saves(cell.key()).saved() if saves is not None else None
        read = 0 if kept is None else kept.fed + (passes - 1) * cell.length * kept.done
        seconds += (passes * cell.length - read) / prefill
        if cell.task == "retrieval":
            batches = len(DEPTHS) * -(-n_per_depth // 10)
            seconds += batches * (30 / prefill + 6 / step)
    return seconds / 3600


def _variant(method: str) -> Variant:
    if method == "full":
        return methods.FULL
    found = {v.method: v for v in methods.retrieval_variants()}
    return found[method]


def _ask_merged(
    model: Any, caches: list[Any], prompt: retrieval.Prompt, batch: int
) -> list[retrieval.Answer]:
    """Every question of ``prompt`` from a copy of ``caches``: questions of one shape as rows of
    one batch (the copies merged per layer), so their answer steps cost about one step."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (q, a) in enumerate(zip(prompt.questions, prompt.answers, strict=True)):
        groups.setdefault((len(q), len(a)), []).append(i)
    out: dict[int, retrieval.Answer] = {}
    for indices in groups.values():
        for start in range(0, len(indices), batch):
            part = indices[start : start + batch]
            copies = [retrieval.clone(caches) for _ in part]
            merged = [type(layer[0]).merge(list(layer)) for layer in zip(*copies, strict=True)]
            questions = mx.array([prompt.questions[i] for i in part], dtype=mx.int32)
            answers = mx.array([prompt.answers[i] for i in part], dtype=mx.int32)
            got = retrieval.ask(model, merged, questions, answers)
            out.update(zip(part, got, strict=True))
    return [out[i] for i in range(len(prompt.questions))]


def _retrieval(
    model: Any,
    tokenizer: Any,
    cell: Cell,
    n_per_depth: int,
    batch: int,
    step: Callable[[int], Any],
    keep: Checkpoint | None,
) -> tuple[dict[str, Any], float]:
    """The cell's questions answered from one read of its document; returns the result and
    the seconds earlier sittings spent on the read (``keep``: where the read is kept)."""
    facts = many_facts(n_per_depth)
    encode = tokenizer.encode
    fact_tokens = sum(len(encode(" " + f.sentence())) for f in facts)
    document = retrieval_document(cell.length - fact_tokens - 64, encode)
    prompt = retrieval.build_prompt(tokenizer, document, facts, where(n_per_depth))
    caches, earlier = _read_document(model, tokenizer, cell, prompt.document, step, keep)
    answers = _ask_merged(model, caches, prompt, batch)
    nominal = [d for d in DEPTHS for _ in range(n_per_depth)]
    by_depth = {}
    for depth in DEPTHS:
        got = [a for a, d in zip(answers, nominal, strict=True) if d == depth]
        by_depth[str(depth)] = {
            "accuracy": float(np.mean([a.correct for a in got])),
            "logprob": float(np.mean([a.logprob for a in got])),
            "n": len(got),
        }
    return {
        "prompt_tokens": len(prompt.document),
        "depths": by_depth,
        "answers": [[a.correct, round(a.logprob, 4)] for a in answers],
        "where": [round(d, 4) for d in prompt.depths],
        "kept_tokens": _kept(caches),
        "kv_bytes_layer0": int(caches[0].nbytes),
        "demoted_tokens": _demoted(caches),
    }, earlier


def _read_document(
    model: Any,
    tokenizer: Any,
    cell: Cell,
    document: list[int],
    step: Callable[[int], Any],
    keep: Checkpoint | None = None,
) -> tuple[list[Any], float]:
    """Fresh caches of the cell's method with ``document`` fed in chunks of 256 (``step`` sees
    each chunk's tokens), then compressed as the method would in use (KVzip's pass).

    With ``keep``, the caches are kept every ``keep.every`` tokens, before the compression pass
    and when the read is done, and a read kept by an earlier sitting goes on from there (its
    chunks stay on the same 256-token grid, so the caches end the same). Returns the caches
    and the seconds earlier sittings spent on this read."""
    from velox_mlx_lm import KVCacheBuilder

    config = cell.config()
    resumed = keep.load(config) if keep is not None else None
    caches, saved = resumed or (KVCacheBuilder.for_model(model, config), Saved(0, False, 0.0))
    began = time.perf_counter()

    def kept(fed: int, done: bool) -> None:
        if keep is not None:
            keep.save(caches, Saved(fed, done, saved.seconds + time.perf_counter() - began))

    step(saved.fed)
    ids = mx.array([document], dtype=mx.int32)
    for start in range(saved.fed, ids.shape[1], 256):
        end = min(start + 256, ids.shape[1])
        model(ids[:, start:end], cache=caches)
        mx.eval([c.state for c in caches])
        step(end - start)
        crossed = keep is not None and end // keep.every > start // keep.every
        if crossed and end < ids.shape[1]:
            kept(end, False)
    if not saved.done:
        if retrieval._reconstructs(config):
            from velox_mlx_lm.kvzip import compress

            kept(len(document), False)  # the pass reads the document again: keep the read
            compress(model, tokenizer, caches, document)
        kept(len(document), True)
    return caches, saved.seconds


def _ruler(
    model: Any,
    tokenizer: Any,
    cell: Cell,
    step: Callable[[int], Any],
    kinds: KindLog | None,
    saves: Callable[[str], Checkpoint] | None,
) -> dict[str, Any]:
    """The four RULER-style tasks (seed 0) at the cell's length, each answered greedily from
    one prefill through the chat template: the context is fed in chunks of 256 (KVzip then
    compresses it, as for retrieval), the question and primer through ``mlx_lm.generate``.
    ``kinds``: where each finished kind is kept, and read back on a rerun (a cell at 8k takes
    up to three hours, longer than a sitting); ``saves``: where each prompt's read is kept
    (:func:`_read_document`)."""
    import mlx_lm

    from velox_mlx_lm.serve.pins import common_prefix

    saved = kinds.saved(cell.key()) if kinds is not None else {}
    tasks = {}
    for kind in ruler.KINDS:
        if kind in saved:
            tasks[kind] = saved[kind]
            step(cell.length)
            continue
        began = time.perf_counter()
        task = ruler.make_task(kind, cell.length, 0, ruler_run.encoder(tokenizer))
        ids = ruler_run.prompt_ids(tokenizer, task)
        bare = replace(task, question="", primer="")  # the context alone: its tokens lead ``ids``
        context = min(common_prefix(ids, ruler_run.prompt_ids(tokenizer, bare)), len(ids) - 1)
        keep = saves(f"{cell.key()}/{kind}") if saves is not None else None
        caches, earlier = _read_document(model, tokenizer, cell, ids[:context], step, keep)
        output = mlx_lm.generate(
            model,
            tokenizer,
            ids[context:],
            max_tokens=ruler_run.MAX_TOKENS[kind],
            prompt_cache=caches,
        )
        step(len(ids) - context)
        tasks[kind] = {
            "score": ruler.score(task, str(output)),
            "output": str(output),
            "prompt_tokens": len(ids),
            "seconds": earlier + time.perf_counter() - began,
        }
        if kinds is not None:
            kinds.keep(cell.key(), kind, tasks[kind])
        if keep is not None:
            keep.clear()
    return {"mean": float(np.mean([t["score"] for t in tasks.values()])), "tasks": tasks}


@dataclass(frozen=True)
class KindLog:
    """The RULER-style kinds finished so far in cells not yet finished: one JSON line each
    (``model``, ``key``, ``kind``, ``result``) in ``path``, beside the results file."""

    path: Path
    model: str

    def saved(self, key: str) -> dict[str, dict[str, Any]]:
        """The finished kinds of cell ``key`` for this model, by kind."""
        rows = read_rows(self.path)
        return {
            r["kind"]: r["result"] for r in rows if r.get("model") == self.model and r["key"] == key
        }

    def keep(self, key: str, kind: str, result: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        row = {"model": self.model, "key": key, "kind": kind, "result": result}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _demoted(caches: list[Any]) -> int:
    from velox_mlx_lm import PolicyKVCache

    return caches[0].demoted_tokens if isinstance(caches[0], PolicyKVCache) else 0


def _kept(caches: list[Any]) -> int | None:
    kept = getattr(caches[0], "tokens_kept", None)
    if kept is None:
        return None
    return int(kept if isinstance(kept, int) else max(kept))


def _text(task: str, length: int, encode: Callable[[str], list[int]]) -> list[int]:
    if task == "ppl_code":
        from velox_bench.quality.code_text import code_text

        tokens = encode(code_text())
    else:
        tokens = encode("\n\n".join(s.text() for s in corpus.most_recent(1, length + 1, encode)))
    if len(tokens) < length + 1:
        raise ValueError(f"the {task} text has {len(tokens)} tokens, fewer than {length + 1}")
    return tokens[: length + 1]


def _perplexity(
    model: Any, tokenizer: Any, cell: Cell, step: Callable[[int], Any]
) -> dict[str, Any]:
    tokens = _text(cell.task, cell.length, tokenizer.encode)
    config = cell.config()
    nll = token_nll(model, config, tokens, chunk=256, on_chunk=step)
    windows = [perplexity(nll[i : i + 1024]) for i in range(0, len(nll), 1024)]
    return {"perplexity": perplexity(nll), "per_1024": windows}


def run_cell(
    model: Any,
    tokenizer: Any,
    cell: Cell,
    *,
    n_per_depth: int = N_PER_DEPTH,
    batch: int = 10,
    step: Callable[[int], Any] = lambda n: None,
    kinds: KindLog | None = None,
    saves: Callable[[str], Checkpoint] | None = None,
) -> dict[str, Any]:
    """Measure one cell; returns its row (the cell's fields, the result, the seconds it took,
    those of earlier sittings included: for a RULER-style cell, its kinds' seconds).

    ``kinds`` keeps the finished RULER-style kinds; ``saves`` gives the checkpoint of a read
    by its key (the cell's, and the kind's for a RULER-style prompt), so a long read goes on
    where an earlier sitting stopped. The retrieval cell's checkpoint stays until its row is
    written (the caller clears it)."""
    began = time.perf_counter()
    earlier = 0.0
    if cell.task == "retrieval":
        # copies of the compressed state per batch: fewer past 8k (a full cache's 16k copies
        # would hold about 1 GB each on the instrument)
        batch = max(1, batch * 8192 // max(cell.length, 8192))
        keep = saves(cell.key()) if saves is not None else None
        result, earlier = _retrieval(model, tokenizer, cell, n_per_depth, batch, step, keep)
    elif cell.task == "ruler":
        result = _ruler(model, tokenizer, cell, step, kinds, saves)
    elif cell.task in ("ppl_code", "ppl_prose"):
        result = _perplexity(model, tokenizer, cell, step)
    else:
        raise ValueError(f"unknown task {cell.task!r}")
    seconds = earlier + time.perf_counter() - began
    if cell.task == "ruler":  # its prompts' own seconds, an earlier sitting's included
        seconds = sum(t["seconds"] for t in result["tasks"].values())
    return {**asdict(cell), "key": cell.key(), **result, "seconds": seconds}


def done_keys(path: Path, model: str) -> set[str]:
    """Keys of the cells already in the results file for ``model``."""
    if not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"] for r in rows if r.get("model") == model}


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
