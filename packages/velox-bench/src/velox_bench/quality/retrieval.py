"""Planted-fact retrieval: pass keys hidden at several depths of a real text, asked at the end.

Each trial plants three facts ("The pass key of <city> is <5 digits>.") in one document, at
relative depths 10%, 50% and 90%, then asks for each through the chat template, the answer
primed with "The pass key of <city> is". The document prefix is run once per trial and its cache
state copied for each question. Measures per question: exact match (greedy decoding yields the
five digits) and the log-probability of the true answer tokens.
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

DEPTHS = (0.1, 0.5, 0.9)
N_FACTS = 30  # fixed pool: trial i always plants the same three facts
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Quito", "Perth", "Tunis", "Riga",
    "Accra", "Bogota", "Cairo", "Dakar", "Havana", "Kyoto", "Lagos", "Manila", "Naples", "Porto",
    "Sofia", "Tallinn", "Vienna", "Warsaw", "Zagreb", "Madrid", "Geneva", "Denver", "Austin",
    "Boston",
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


def build_prompt(tokenizer: Any, document: str, planted: Sequence[Fact]) -> Prompt:
    """Plant ``planted`` at ``DEPTHS`` of ``document`` and tokenize through the chat template."""
    text = plant(document, planted)
    doc_ids: list[int] = []
    questions, answers, depths = [], [], []
    for fact in planted:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{text}\n\n{fact.question()}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        end = rendered.index(text) + len(text)
        head = tokenizer.encode(rendered[:end], add_special_tokens=False)
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
    """Independent copies of per-layer caches (mx arrays are immutable; states are rebuilt)."""
    return [type(c).from_state(c.state) for c in caches]


@dataclass(frozen=True)
class Answer:
    correct: bool  # greedy decoding reproduces every answer token
    logprob: float  # log p(answer tokens | document, question), natural log


def ask(model: nn.Module, caches: list[Any], question: list[int], answer: list[int]) -> Answer:
    """Feed the question as one chunk, then the answer one token at a time (teacher forcing).

    Single-token steps are what decoding does (and where SnapKV compresses its prompt).
    """
    logits = model(mx.array(question, dtype=mx.int32)[None], cache=caches)[0, -1]
    total, correct = 0.0, True
    for i, token in enumerate(answer):
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
        mx.eval(logprobs)
        total += float(logprobs[token].item())
        correct = correct and int(np.array(mx.argmax(logprobs))) == token
        if i + 1 < len(answer):
            logits = model(mx.array([[token]], dtype=mx.int32), cache=caches)[0, -1]
    return Answer(correct, total)


def run_trial(
    model: nn.Module,
    config: KVCacheConfig,
    prompt: Prompt,
    chunk: int = 256,
    on_tokens: Callable[[int], Any] | None = None,
) -> list[Answer]:
    """One answer per planted fact; the document is run once and its cache copied."""
    caches = KVCacheBuilder.for_model(model, config)
    ids = mx.array(prompt.document, dtype=mx.int32)[None]
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start : start + chunk], cache=caches)
        mx.eval([c.state for c in caches])
        if on_tokens is not None:
            on_tokens(min(chunk, ids.shape[1] - start))
    out = []
    for question, answer in zip(prompt.questions, prompt.answers, strict=True):
        out.append(ask(model, clone(caches), question, answer))
        if on_tokens is not None:
            on_tokens(len(question) + len(answer))
    return out
