"""KVzip for mlx-lm: compress a prefilled context once, then ask it many questions.

Typical use::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", kvzip_budget=512))
    prefill(model, caches, context)                      # the document's tokens
    compress(model, tokenizer, caches, context)          # the reconstruction pass and the cut
    save_prompt_cache("doc.safetensors", caches)         # reuse for every question

``compress`` feeds, chunk by chunk, a reconstruction prompt through the model with the caches
in scoring mode (:class:`velox_mlx_lm.cache.KVzipKVCache`): an instruction to repeat the
context (in the model's chat format where the tokenizer has one, continuing the user turn the
context sits in), then the chunk's context tokens, teacher-forced. Each context row is scored by
the largest attention weight the chunk that repeats it gives it (see
``velox_cache_core.policies.kvzip.reconstruction_scores``), the rows are cut to ``budget`` per
KV head on average (``allocation="global"``, the default: one threshold across every head of
every layer, found here; ``"layer"``; ``"head"``: uniform), and the reconstruction tokens leave
nothing behind: the cache holds the context alone,
with its true positions and ``offset == len(context)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from velox_cache_core.policies.kvzip import global_totals
from velox_mlx_lm.cache import KVzipKVCache
from velox_mlx_lm.hook import install_attention_hook

CHUNK_SIZE = 512
FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk quoted in the next chunk's instruction
_SEPARATOR = "\n" + "#" * 13


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def reply_prefix(tokenizer: Any) -> list[int]:
    """Tokens that end a user turn and open the assistant's (``"\\n"`` without a chat
    template)."""
    if not getattr(tokenizer, "chat_template", None):
        return _encode(tokenizer, "\n")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "dummy context" + _SEPARATOR}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return _encode(tokenizer, rendered.split(_SEPARATOR, 1)[1])


def reconstruction_chunks(
    tokenizer: Any, tokens: Sequence[int], chunk_size: int = CHUNK_SIZE
) -> list[tuple[int, int, list[int]]]:
    """``(start, end, input ids)`` of every reconstruction chunk: the instruction, the reply
    prefix, then ``tokens[start:end]``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    reply = reply_prefix(tokenizer)
    first, later = _encode(tokenizer, FIRST), _encode(tokenizer, NEXT)
    out = []
    for start in range(0, len(tokens), chunk_size):
        end = min(start + chunk_size, len(tokens))
        head = first if start == 0 else later + list(tokens[max(0, start - OVERLAP) : start])
        out.append((start, end, [*head, *reply, *tokens[start:end]]))
    return out


def prefill(model: Any, caches: list[Any], tokens: Sequence[int], step: int = 512) -> None:
    """Feed ``tokens`` (the context) through the model into ``caches``, ``step`` at a time."""
    for s in range(0, len(tokens), step):
        model(mx.array(list(tokens[s : s + step]), dtype=mx.int32)[None], cache=caches)
        mx.eval([c.state for c in caches])


def compress(
    model: Any,
    tokenizer: Any,
    caches: list[Any],
    tokens: Sequence[int],
    budget: int | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> dict[str, Any]:
    """Compress prefilled KVzip ``caches`` in place; ``tokens`` are the ids they hold (the whole
    context, ``len(tokens) == offset``). ``budget`` overrides the caches' own. Other layer
    caches (sliding windows) must be trimmable: the reconstruction tokens are trimmed from them.

    Returns ``{"context_tokens", "scored_tokens", "chunks"}`` (``scored_tokens``: tokens the
    reconstruction pass fed, about one extra prefill of the context).
    """
    zipped = [c for c in caches if isinstance(c, KVzipKVCache)]
    if not zipped:
        raise ValueError("compress() needs KVzip caches (KVCacheConfig(method='kvzip'))")
    others = [c for c in caches if not isinstance(c, KVzipKVCache)]
    n = len(tokens)
    offsets = {c.offset for c in zipped}
    if offsets != {n}:
        raise ValueError(f"the caches hold {sorted(offsets)} tokens, but {n} tokens were given")
    if zipped[0].settings["probe"] == "latest":
        for c in zipped:
            c.compress_latest(budget)
        mx.eval([c.state for c in zipped])
        return {"context_tokens": n, "scored_tokens": 0, "chunks": 0}
    for c in others:
        if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
            raise ValueError(f"cannot run the reconstruction pass past a {type(c).__name__}")
    install_attention_hook(model)
    chunks = reconstruction_chunks(tokenizer, tokens, chunk_size)
    scored = 0
    for c in zipped:
        c.start_scoring()
    try:
        for start, end, ids in chunks:
            for c in zipped:
                c.score_chunk(start, end)
            model(mx.array(ids, dtype=mx.int32)[None], cache=caches)  # logits stay unevaluated
            mx.eval([c.chunk_scores() for c in zipped])
            for c in others:
                c.trim(len(ids))
            scored += len(ids)
        totals: list[int | None] = [None] * len(zipped)
        if zipped[0].settings["allocation"] == "global":  # one threshold over every layer
            cut = zipped[0].settings["budget"] if budget is None else budget
            sink = zipped[0].settings["n_sink"]
            totals = list(global_totals([c.scores() for c in zipped], cut, sink))
        for c, total in zip(zipped, totals, strict=True):
            c.finish_scoring(budget, total)
    finally:
        for c in zipped:  # after an error, leave the caches usable (uncompressed)
            if c.scoring:
                c._kvzip_scores = c._kvzip_chunk = c._kvzip_recon = None
    mx.eval([c.state for c in zipped])
    return {"context_tokens": n, "scored_tokens": scored, "chunks": len(chunks)}
