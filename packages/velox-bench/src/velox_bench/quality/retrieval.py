"""Planted-fact retrieval: pass keys hidden at several depths of a real text, asked at the end.

Each trial plants three facts ("The pass key of <city> is <5 digits>.") in one document, at
relative depths 10%, 50% and 90%, then asks for each through the chat template (a base model:
as plain text), the answer primed with "The pass key of <city> is". The document prefix is run
once per trial and its cache state copied for each question; trials whose prompts have the same
shape run as one batch (rows never see each other, tested). Measures per question: exact match
(greedy decoding yields the five digits) and the log-probability of the true answer tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.builder import link_shares

DEPTHS = (0.1, 0.5, 0.9)
N_FACTS = 40  # fixed pool: trial i always plants the same three facts
# One token each (with a leading space), so every trial's prompt has the same shape and trials
# run as one batch (``run_trials``); prompts that differ in shape would still run, apart.
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Dublin", "Perth", "Tunis", "Cairo", "Havana", "Kyoto",
    "Manila", "Naples", "Sofia", "Vienna", "Warsaw", "Madrid", "Geneva", "Denver", "Austin",
    "Boston", "Paris", "London", "Rome", "Berlin", "Tokyo", "Moscow", "Chicago", "Dallas",
    "Seattle", "Miami",
)  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Fact:
    city: str
    number: int

    def sentence(self) -> str:
        return (
            f"The pass key of {self.city} is {self.number}. Remember it. "
            f"The pass key of {self.city} is {self.number}."
        )

    def question(self) -> str:
        return f"What is the pass key of {self.city}? Answer with the number."

    def primer(self) -> str:
        return f"The pass key of {self.city} is"

    def answer(self) -> str:
        return f" {self.number}"


def facts(trial: int) -> tuple[Fact, ...]:
    """The three facts of trial ``trial`` (0 <= trial < N_FACTS), one per depth; fixed."""
    if not 0 <= trial < N_FACTS:
        raise ValueError(f"trial must be in [0, {N_FACTS}), got {trial}")
    rng = random.Random(1000 + trial)
    cities = rng.sample(CITIES, len(DEPTHS))
    return tuple(Fact(city, rng.randrange(10_000, 100_000)) for city in cities)


def cut_document(text: str, n_tokens: int, encode: Callable[[str], list[int]]) -> str:
    """The longest run of whole sentences from the start of ``text`` within ``n_tokens``."""
    sentences = _SENTENCE_END.split(text.strip())
    out: list[str] = []
    for sentence in sentences:
        if len(encode(" ".join([*out, sentence]))) > n_tokens:
            break
        out.append(sentence)
    return " ".join(out)


def plant(document: str, planted: Sequence[Fact], depths: Sequence[float] = DEPTHS) -> str:
    """Insert each fact's sentence at the sentence boundary nearest its relative depth."""
    sentences = _SENTENCE_END.split(document)
    starts, total = [], 0
    for sentence in sentences:
        starts.append(total)
        total += len(sentence) + 1
    inserts: dict[int, list[str]] = {}
    for fact, depth in zip(planted, depths, strict=True):
        index = min(range(len(sentences)), key=lambda i: abs(starts[i] - depth * total))
        inserts.setdefault(index, []).append(fact.sentence())
    out: list[str] = []
    for i, sentence in enumerate(sentences):
        out += inserts.get(i, [])
        out.append(sentence)
    return " ".join(out)


@dataclass(frozen=True)
class Prompt:
    """Token ids: the shared document part, then per question the question and its answer."""

    document: list[int]
    questions: list[list[int]]  # question + chat template end + primer
    answers: list[list[int]]
    depths: list[float]  # where each fact starts, as a fraction of the document's tokens

    def shape(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Prompts of equal shape can run as one batch."""
        return len(self.document), tuple(map(len, self.questions)), tuple(map(len, self.answers))


def has_chat_template(tokenizer: Any) -> bool:
    """Whether prompts go through the tokenizer's chat template (a base model has none and
    is prompted with plain text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def _rendered(tokenizer: Any, text: str, fact: Fact, chat: bool) -> str:
    """The document and the question: through the chat template when ``chat``, else plain
    text (a base model), the question on a line of its own."""
    if chat:
        return str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{text}\n\n{fact.question()}"}],
                add_generation_prompt=True,
                tokenize=False,
            )
        )
    return f"{text}\n\n{fact.question()}\n"


def build_prompt(
    tokenizer: Any,
    document: str,
    planted: Sequence[Fact],
    where: Sequence[float] = DEPTHS,
) -> Prompt:
    """Plant ``planted`` at relative depths ``where`` (one each) of ``document`` and tokenize
    through the chat template, or as plain text with the tokenizer's BOS when it has no chat
    template (a base model such as Gemma 3 270M)."""
    text = plant(document, planted, where)
    chat = has_chat_template(tokenizer)
    doc_ids: list[int] = []
    questions, answers, depths = [], [], []
    for fact in planted:
        rendered = _rendered(tokenizer, text, fact, chat)
        end = rendered.index(text) + len(text)
        head = tokenizer.encode(rendered[:end], add_special_tokens=not chat)
        tail = rendered[end:] + fact.primer()
        asked = tokenizer.encode(tail, add_special_tokens=False)
        full = tokenizer.encode(tail + fact.answer(), add_special_tokens=False)
        if full[: len(asked)] != asked or doc_ids not in ([], head):
            raise ValueError("the answer does not tokenize apart from the question")
        doc_ids = head
        questions.append(asked)
        answers.append(full[len(asked) :])
        at = rendered.index(fact.sentence())
        depths.append(len(tokenizer.encode(rendered[:at], add_special_tokens=False)) / len(head))
    return Prompt(doc_ids, questions, answers, depths)


def clone(caches: list[Any]) -> list[Any]:
    """Independent copies of per-layer caches (mx arrays are immutable; states are rebuilt),
    linked again where a model-wide ``global`` allocation is still to cut them."""
    return link_shares([type(c).from_state(c.state) for c in caches])


@dataclass(frozen=True)
class Answer:
    correct: bool  # greedy decoding reproduces every answer token
    logprob: float  # log p(answer tokens | document, question), natural log


def answer_stats(got: Sequence[Answer], ref: Sequence[Answer]) -> dict[str, float]:
    """Exact-match accuracy and mean log-probability of ``got``, and its mean log-probability
    over that of ``ref`` (the full cache's answers to the same questions, in the same order)."""
    return {
        "accuracy": float(np.mean([a.correct for a in got])),
        "logprob": float(np.mean([a.logprob for a in got])),
        "logprob_vs_full": float(
            np.mean([a.logprob - r.logprob for a, r in zip(got, ref, strict=True)])
        ),
    }


def ask(
    model: nn.Module, caches: list[Any], questions: mx.array, answers: mx.array
) -> list[Answer]:
    """Feed ``questions`` ``[B, Q]`` as one chunk, then ``answers`` ``[B, A]`` one token at a time.

    Teacher forcing: each row's true answer token is fed, whatever was predicted. Single-token
    steps are what decoding does (and where SnapKV compresses its prompt). One answer per row.
    """
    logits = model(questions, cache=caches)[:, -1]
    total = np.zeros(answers.shape[0])
    correct = np.ones(answers.shape[0], dtype=bool)
    for i in range(answers.shape[1]):
        scores = logits.astype(mx.float32)
        logprobs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
        token = answers[:, i]
        picked = mx.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
        best = mx.argmax(logprobs, axis=-1)
        mx.eval(picked, best)
        total += np.array(picked, dtype=np.float64)
        correct &= np.array(best) == np.array(token)
        if i + 1 < answers.shape[1]:
            logits = model(answers[:, i : i + 1], cache=caches)[:, -1]
    return [Answer(bool(c), float(t)) for c, t in zip(correct, total, strict=True)]


def _one_sequence(config: KVCacheConfig) -> bool:
    """Whether ``config`` cuts one sequence at a time: KVzip's reconstruction pass, or a
    model-wide ``global`` allocation (one threshold per sequence)."""
    return _reconstructs(config) or config.settings().get("allocation") == "global"


def _reconstructs(config: KVCacheConfig) -> bool:
    """Whether ``config`` is KVzip with its reconstruction pass (a model pass per document)."""
    return config.policy == "kvzip" and config.settings().get("probe", "reconstruct") != "latest"


def _prefill_batch(
    model: nn.Module,
    caches: list[Any],
    prompts: Sequence[Prompt],
    *,
    chunk: int,
    on_tokens: Callable[[int], Any] | None,
) -> None:
    """Feed the documents of ``prompts`` (one shape) into ``caches`` as ``[B, chunk]`` steps,
    each evaluated; ``on_tokens`` counts the tokens of every row."""
    ids = mx.array([p.document for p in prompts], dtype=mx.int32)  # [B, document]
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start : start + chunk], cache=caches)
        mx.eval([c.state for c in caches])
        if on_tokens is not None:
            on_tokens(len(prompts) * min(chunk, ids.shape[1] - start))


def _ask_batch(
    model: nn.Module,
    caches: list[Any],
    prompts: Sequence[Prompt],
    *,
    on_tokens: Callable[[int], Any] | None,
) -> list[list[Answer]]:
    """Each question of ``prompts`` (one shape) asked of every row at once (``[B, Q]``), from a
    copy of the filled ``caches``; per prompt, its answers in order."""
    out: list[list[Answer]] = [[] for _ in prompts]
    for q in range(len(prompts[0].questions)):
        questions = mx.array([p.questions[q] for p in prompts], dtype=mx.int32)
        answers = mx.array([p.answers[q] for p in prompts], dtype=mx.int32)
        for row, answer in zip(out, ask(model, clone(caches), questions, answers), strict=True):
            row.append(answer)
        if on_tokens is not None:
            on_tokens(len(prompts) * (questions.shape[1] + answers.shape[1]))
    return out


def run_batch(
    model: nn.Module,
    config: KVCacheConfig,
    prompts: Sequence[Prompt],
    chunk: int = 256,
    on_tokens: Callable[[int], Any] | None = None,
    tokenizer: Any = None,
) -> list[list[Answer]]:
    """Prompts of one shape as one batch; the documents run once and the caches are copied.

    KVzip (reconstruction probe) compresses each document once after its prefill
    (``velox_mlx_lm.kvzip.compress``, which needs ``tokenizer``), one prompt at a time (its
    global threshold is per sequence); every question then starts from a copy of that cut. A
    ``global`` allocation of another policy also runs one prompt at a time.
    """
    if len({p.shape() for p in prompts}) != 1:
        raise ValueError("run_batch needs prompts of one shape: group them with run_trials")
    if _reconstructs(config) and tokenizer is None:
        raise ValueError("KVzip's reconstruction pass needs the tokenizer (tokenizer=...)")
    if _one_sequence(config) and len(prompts) > 1:
        return [
            run_batch(model, config, [p], chunk=chunk, on_tokens=on_tokens, tokenizer=tokenizer)[0]
            for p in prompts
        ]
    caches = KVCacheBuilder.for_model(model, config)
    _prefill_batch(model, caches, prompts, chunk=chunk, on_tokens=on_tokens)
    if _reconstructs(config):
        from velox_mlx_lm.kvzip import compress

        compress(model, tokenizer, caches, prompts[0].document)
    return _ask_batch(model, caches, prompts, on_tokens=on_tokens)


def run_trials(
    model: nn.Module,
    config: KVCacheConfig,
    prompts: Sequence[Prompt],
    chunk: int = 256,
    batch: int = 10,
    on_tokens: Callable[[int], Any] | None = None,
    tokenizer: Any = None,
) -> list[list[Answer]]:
    """One answer per planted fact of each prompt, in order; batches of up to ``batch`` prompts.

    Batching only groups prompts of the same shape, so every row is computed exactly as alone.
    ``tokenizer``: needed by KVzip's reconstruction pass (see :func:`run_batch`).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    groups: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt.shape(), []).append(i)
    out: dict[int, list[Answer]] = {}
    for indices in groups.values():
        for start in range(0, len(indices), batch):
            part = indices[start : start + batch]
            chosen = [prompts[i] for i in part]
            answers = run_batch(
                model, config, chosen, chunk=chunk, on_tokens=on_tokens, tokenizer=tokenizer
            )
            out.update(zip(part, answers, strict=True))
    return [out[i] for i in range(len(prompts))]
