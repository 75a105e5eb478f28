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

import mlx.core as mx

from velox_cache_core import Compaction, Layer, pinned, rotate

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
    pins = state.pins  # pinned rows keep their RoPE positions, as sinks do

    def fixed(positions: mx.array) -> mx.array:
        return pinned(positions, pins)

    slots, tier, after, delta = comp.shift(
        state.slots, token, length, None if pins is None else fixed, layer.tier
    )
    layer.tier = tier  # the demoted rows shift with the main rows (their budget counts in top)
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


def feed_row(
    layer: Layer,
    comp: Compaction | None,
    keys: mx.array,
    values: mx.array,
    queries: mx.array,
    scale: float,
    sinks: mx.array | None,
) -> tuple[mx.array, Compaction | None]:
    """One call of a batch's row fed to its layer as the same sequence alone takes it
    (``PolicyKVCache``): the tokens before the context, the shift, then the rest rotated by
    it (keys and queries). Returns the attention output ``[1, H_q, L, D]`` and the row's
    compaction after."""
    length = int(keys.shape[2])
    if comp is None or not comp.needs_shift(layer.offset, length):
        layer.lay_out(keys, values)
        return layer.attend(queries, scale, sinks), comp
    first = max(0, comp.context - comp.offset(layer.offset))
    comp.check_fits(length - first)
    outs = []
    if first:
        layer.lay_out(keys[:, :, :first], values[:, :, :first])
        outs.append(layer.attend(queries[:, :, :first], scale, sinks))
    comp, delta = shift_layer(layer, comp, length - first)
    layer.lay_out(rotate(keys[:, :, first:], delta, comp.rope), values[:, :, first:])
    outs.append(layer.attend(rotate(queries[:, :, first:], delta, comp.rope), scale, sinks))
    return (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)), comp
