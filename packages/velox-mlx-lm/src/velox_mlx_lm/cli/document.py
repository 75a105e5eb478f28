"""``velox-generate`` with a policy that declares a model-driven phase (KVzip): the prompt's
document is prefilled, compressed by the phase's pass, then the question is answered."""

from __future__ import annotations

import argparse
import time
from typing import Any

from velox_mlx_lm.cli.generation import Run, generate_once
from velox_mlx_lm.compress import compress, prefill


def prompt_tokens(text: str, chat: bool, tokenizer: Any) -> list[int]:
    """The prompt's token ids (in the chat template when ``chat`` and the tokenizer has one)."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def split_document(text: str, chat: bool, tokenizer: Any) -> tuple[list[int], list[int]]:
    """A document-phase method (``--method kvzip``): the prompt's tokens as (document, rest).
    The document is the prompt minus its last non-empty line (the question; for ``--demo``,
    the demo's question), with the chat template's opening where it applies; the rest is the
    question and the template's closing."""
    body = text.rstrip()
    cut = body.rfind("\n")
    if cut <= 0 or not body[:cut].strip():
        raise ValueError(
            "a method with a document phase needs a document and, on its last line, the question"
        )
    full = prompt_tokens(text, chat, tokenizer)
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        head = rendered[: rendered.index(text) + cut]
        document = list(tokenizer.encode(head, add_special_tokens=False))
    else:
        document = list(tokenizer.encode(text[:cut]))
    n = 0  # the longest common prefix (token merges may differ at the boundary)
    while n < min(len(document), len(full) - 1) and document[n] == full[n]:
        n += 1
    return full[:n], full[n:]


def document_run(
    model: Any,
    tokenizer: Any,
    text: str,
    chat: bool,
    caches: list[Any],
    args: argparse.Namespace,
    label: str,
    echo: bool,
) -> Run:
    """Prefill the document, compress it (the policy's model-driven phase), then generate
    the answer to the rest; the phase's stats are named after the method."""
    document, rest = split_document(text, chat, tokenizer)
    started = time.perf_counter()
    prefill(model, caches, document, step=args.prefill_step_size)
    prefilled = time.perf_counter()
    info = compress(model, tokenizer, caches, document)
    scored = time.perf_counter()
    run = generate_once(model, tokenizer, rest, caches, args, label, echo)
    run.stats = {
        "document_tokens": len(document),
        **run.stats,
        "document_prefill_s": round(prefilled - started, 2),
        f"{args.method}_scoring_s": round(scored - prefilled, 2),
        f"{args.method}_scored_tokens": info["scored_tokens"],
    }
    return run
