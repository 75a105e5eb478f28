"""A call that waits for its queries on a :class:`velox_cache_core.layer.Layer`: laid out now
(``retained + new`` returned to the model), decided when ``attend`` brings them.

A chunk waits (``attend`` may split it and mask per head), as does a call whose state scores by
the true queries or a layer with a demoted tier, unless the layer's mode decides at once. Each
function is bound as a method of ``Layer``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_cache_core import demoted, fast_step, step_sums
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.in_flight import SUBCHUNK, Mode, Waiting
from velox_cache_core.store import rows
from velox_cache_core.validation import check_fits


def waits(layer: Any, length: int) -> bool:
    """Whether a call of ``length`` tokens waits for ``attend``: a chunk or a state scoring by
    the true queries (or a layer with a tier), unless the mode decides at once."""
    if layer.mode is Mode.AT_ONCE:
        return False
    return (
        length > 1 or layer.demote is not None or layer.policy.traits.signal(layer.state) == "query"
    )


def wait(layer: Any, keys: rows.Rows, values: rows.Rows) -> tuple[rows.Rows, rows.Rows]:
    """Leave the call pending and return ``retained + new``."""
    slots = layer.state.slots
    check_fits(slots, keys, values)
    layer.pending = Waiting(keys, values)
    if slots is None:
        return keys, values
    if keys.shape[2] == 1 and slots.free is not None:
        # Fewer ops than a compaction plus a concatenation, which the hook then ignores.
        laid_out = slots.write_free(keys, values, layer.state.offset)
        return laid_out.keys, laid_out.values
    return fast_step.retained_plus_new(slots, keys, values)


def decide(
    layer: Any, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
) -> mx.array:
    """Decide the waiting call with its ``[B, H_q, L, D]`` queries and attend: with the tier,
    in sub-chunks (a sequential prefill), deferred for the group's sums, or in one update."""
    keys, values = pending.keys, pending.values
    L = int(keys.shape[2])
    if layer.demote is not None:
        return demoted.decide(layer, pending, queries, scale, sinks)
    if L > SUBCHUNK and layer.policy.traits.prefill(layer.state) == "sequential":
        # SUBCHUNK queries at a time: the same decisions, the scan and the attention over
        # retained + SUBCHUNK keys instead of retained + L
        outs = []
        for s in range(0, L, SUBCHUNK):
            part = slice(s, s + SUBCHUNK)
            q, k, v = queries[:, :, part], keys[:, :, part], values[:, :, part]
            step = layer._feed(layer.state, keys=k, values=v, queries=q, scale=scale)
            layer.state = step.state
            outs.append(attend_step(q, step, scale, sinks))
        layer.state = layer._after_call(layer.state, L)
        return mx.concatenate(outs, axis=2)
    if L == 1 and layer.mode is Mode.STEP_SUMS:
        return step_sums.attend_deferring(layer, pending, queries, scale, sinks)
    step = layer._feed(layer.state, keys=keys, values=values, queries=queries, scale=scale)
    layer.state = layer._after_call(step.state, L)
    layer.last = step
    return attend_step(queries, step, scale, sinks)
