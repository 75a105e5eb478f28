"""Compact positions in mlx-lm caches: the shift of one core layer's rows
(``velox_cache_core.store.rope_shift``) and what ``positions`` accepts.

A single-sequence cache (``PolicyKVCache``) keeps one :class:`Compaction`; a batched one
(``BatchVeloxKVCache``) one per row. Either shifts a layer's kept rows when a call would reach
the model's context (before the call: its keys and queries, rotated by the model at the old
positions, are rotated by ``-Δ`` too) or when the next token would (after a call's attention),
so that ``offset`` stays below the context between calls.
"""

from __future__ import annotations

from dataclasses import replace

from velox_cache_core import Layer
from velox_cache_core.store.rope_shift import Compaction

# What ``positions`` accepts (KVCacheConfig, --positions): RoPE at the token index, or compacted
# below the model's context.
POSITIONS = ("absolute", "compact")
# The policies whose rows compact positions can shift: every kept row is a token of its own
# (no shared history rows), and no running field holds rotated keys or queries.
COMPACT_POLICIES = ("tova", "h2o", "streaming_llm")


def shift_layer(layer: Layer, comp: Compaction, length: int) -> tuple[Compaction, int]:
    """Compact ``layer``'s kept rows before a call of ``length`` tokens (``length=1`` after a
    call: for the next token); returns the compaction after and Δ, the rotation the call's
    keys and queries still need. The undo log is cleared: no trim reaches back past a shift."""
    layer.settle()
    state = layer.state
    token = int(state.offset)
    slots, after, delta = comp.shift(state.slots, token, length)
    log = None if layer.log is None else layer.log.cleared()
    if slots is not state.slots:
        layer.restore(replace(state, slots=slots), log)
    else:
        layer.log = log
    return after, delta


def same_compaction(a: Compaction | None, b: Compaction | None) -> bool:
    """Whether two rows may share a batch: both absolute, or both compact under the same
    context, rotation, budget and sinks (their shifts may differ)."""
    if a is None or b is None:
        return a is b
    return (a.context, a.rope, a.top, a.n_sink) == (b.context, b.rope, b.top, b.n_sink)
