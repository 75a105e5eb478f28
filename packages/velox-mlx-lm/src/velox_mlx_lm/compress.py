"""A policy's model-driven phase for mlx-lm (KVzip's): compress a prefilled context once, then
ask it many questions.

Typical use::

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzip", kvzip_budget=512))
    prefill(model, caches, context)                      # the document's tokens
    compress(model, tokenizer, caches, context)          # the reconstruction pass and the cut
    save_prompt_cache("doc.safetensors", caches)         # reuse for every question

``compress`` feeds, chunk by chunk, a reconstruction prompt through the model with the caches
in their policy's scoring phase (:class:`velox_cache_core.layer.Layer`, the policy's
``Compressor`` scoring each chunk): an instruction to repeat the
context (in the model's chat format where the tokenizer has one, continuing the user turn the
context sits in), then the chunk's context tokens, teacher-forced. Each context row is scored by
the largest attention weight the chunk that repeats it gives it (see
``velox_cache_core.policies.kvzip.reconstruction_scores``), the rows are cut to ``budget`` per
KV head on average (``allocation="global"``, the default: one threshold across every head of
every layer, found here; ``"head"``: each layer's heads by score; ``"uniform"``), and the
reconstruction tokens leave nothing behind: the cache holds the context alone, with its true
positions and ``offset == len(context)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from velox_cache_core import Layer
from velox_mlx_lm.cache import PolicyKVCache
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


def phase_caches(caches: list[Any]) -> list[PolicyKVCache]:
    """The caches of ``caches`` whose policy declares a model-driven phase."""
    return [
        c for c in caches if isinstance(c, PolicyKVCache) and c.layer.policy.compressor is not None
    ]


def compress(
    model: Any,
    tokenizer: Any,
    caches: list[Any],
    tokens: Sequence[int],
    budget: int | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> dict[str, Any]:
    """Run the model-driven phase of prefilled ``caches`` in place (KVzip's compression);
    ``tokens`` are the ids they hold (the whole context, ``len(tokens) == offset``).
    ``budget`` overrides the caches' own. Other layer caches (sliding windows) must be
    trimmable: the pass's tokens are trimmed from them.

    Returns ``{"context_tokens", "scored_tokens", "chunks"}`` (``scored_tokens``: tokens the
    pass fed, about one extra prefill of the context).
    """
    zipped = phase_caches(caches)
    if not zipped:
        raise ValueError("compress() needs caches of a policy with a model-driven phase")
    n = len(tokens)
    offsets = {c.offset for c in zipped}
    if offsets != {n}:
        raise ValueError(f"the caches hold {sorted(offsets)} tokens, but {n} tokens were given")
    layers = [c.layer for c in zipped]
    if not layers[0].compressor.needs_pass(layers[0].state):
        _cut_at_prompt_end(layers, budget)
        return {"context_tokens": n, "scored_tokens": 0, "chunks": 0}
    others = [c for c in caches if not any(c is z for z in zipped)]
    for c in others:
        if not (hasattr(c, "is_trimmable") and c.is_trimmable()):
            raise ValueError(f"cannot run the reconstruction pass past a {type(c).__name__}")
    install_attention_hook(model)
    chunks = reconstruction_chunks(tokenizer, tokens, chunk_size)
    scored = _score_and_cut(model, caches, layers, others, chunks, budget)
    mx.eval([layer.state for layer in layers])
    return {"context_tokens": n, "scored_tokens": scored, "chunks": len(chunks)}


def _cut_at_prompt_end(layers: list[Layer], budget: int | None) -> None:
    """A phase without a pass (KVzip's ``probe="latest"``): the prompt's end cuts."""
    for layer in layers:
        layer.settle()
        layer.state = layer.policy.rebudget(layer.state, budget)
        layer.end_prompt()
    mx.eval([layer.state for layer in layers])


def _score_and_cut(
    model: Any,
    caches: list[Any],
    layers: list[Layer],
    others: list[Any],
    chunks: list[tuple[int, int, list[int]]],
    budget: int | None,
) -> int:
    """Feed every pass chunk, then cut each layer by its scores; after an error the layers
    leave the phase uncompressed (usable). Returns the tokens fed."""
    scored = 0
    for layer in layers:
        layer.start_phase()
    try:
        for start, end, ids in chunks:
            for layer in layers:
                layer.score_chunk(start, end)
            model(mx.array(ids, dtype=mx.int32)[None], cache=caches)  # logits stay unevaluated
            mx.eval([layer.phase.scores[-1] for layer in layers if layer.phase is not None])
            for c in others:
                c.trim(len(ids))
            scored += len(ids)
        first = layers[0]
        scores = [layer.phase_scores() for layer in layers]
        totals = first.compressor.shares(scores, first.policy.rebudget(first.state, budget))
        for layer, total in zip(layers, totals, strict=True):
            layer.finish_phase(budget, total)
        for cache in phase_caches(caches):  # the pass's last chunk is no longer needed
            cache.finish_prefill()
    finally:
        for layer in layers:
            layer.abort_phase()
    return scored
