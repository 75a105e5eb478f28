"""A decode step under shared step sums (mode ``STEP_SUMS``, tensor parallel): attend now, decide
when the forward pass's layer-wide sums arrive.

A layer in mode ``STEP_SUMS`` (:meth:`velox_cache_core.layer.Layer.share_step_sums`) records the
sums its decision needs (:class:`velox_cache_core.distributed.Recorder`) instead of summing them
over the group at once; the model's :class:`~velox_cache_core.distributed.StepSums` sends every
layer's in one ``all_sum`` per pass and replays them into :func:`finish`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.distributed import Group, Recorder, Replay, StepSums, summing_over
from velox_cache_core.engine import decide, prepare
from velox_cache_core.in_flight import Deferred, Mode, Waiting


def attend_deferring(
    layer: Any, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
) -> mx.array:
    """Attend now; decide when the pass's last layer has arrived (:meth:`finish`)."""
    sums = layer.sums
    assert sums is not None
    recorder = Recorder(layer.group)
    laid = prepare(
        layer.policy,
        layer.state,
        keys=pending.keys,
        values=pending.values,
        queries=queries,
        scale=scale,
        check_finite=False,
    )
    with summing_over(recorder):
        step = decide(layer.policy, laid, layer.log)
    if recorder.sums:  # the decision waits for the sums; the attention does not
        layer.pending = Deferred(laid)
        sums.defer(recorder.sums, layer.finish)
        step = replace(step, values=laid.candidates.values)
    else:  # nothing was summed over the group: this is the decision
        layer.log = step.log
        layer.state = layer._after_call(step.state, 1)
    out = attend_step(queries, step, scale, sinks)
    tied = sums.arrive(layer.index)
    return mx.depends([out], tied)[0] if tied else out


def finish(layer: Any, replay: Replay) -> list[mx.array]:
    """Decide the deferred step with the group's sums; its new arrays, to evaluate with
    the forward pass (the log's rows then hold no lazy read of slots written in place)."""
    pending, layer.pending = layer.pending, None
    assert isinstance(pending, Deferred)
    with summing_over(replay):
        step = decide(layer.policy, pending.laid, layer.log)
    layer.log = step.log
    layer.state = layer._after_call(step.state, 1)
    tied = layer.state.slots.arrays()
    if step.log is not None and step.log.entries:
        tied += step.log.entries[-1].arrays()
    return tied


# -- wiring (the builder decides the mode once): Layer.connect, Layer.share_step_sums ----
def connect(layer: Any, group: Any) -> None:
    """``Layer.connect``: decide layer-wide over ``group`` (an ``mx.distributed.Group``;
    ``None`` or a group of one rank: alone); leaves ``STEP_SUMS``."""
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
    layer.settle()
    layer.group = None if group is None or group.size() == 1 else group
    layer.sums = None
    if layer.mode is Mode.STEP_SUMS:
        layer.mode = Mode.QUERIES


def share_step_sums(layer: Any, sums: StepSums | None, index: int = 0) -> None:
    """``Layer.share_step_sums``: mode ``STEP_SUMS`` through ``sums`` (over this layer's
    group) as layer ``index`` (``None``: back to ``QUERIES``)."""
    if sums is not None:
        if layer.demote is not None:
            raise ValueError(
                "a layer with a demoted tier (demote_bits) decides every call with its queries, "
                "summing over its group there (one all_sum per layer and call): it cannot defer "
                "a decode step to shared step sums (StepSums)"
            )
        if not isinstance(sums, StepSums):
            raise TypeError(f"sums must be a StepSums, got {type(sums).__name__}")
        if sums.group is not layer.group:
            raise ValueError("sums must communicate over this cache's group")
        if not isinstance(index, int) or not 0 <= index < sums.layers:
            raise ValueError(f"layer must be an int in [0, {sums.layers}), got {index!r}")
    layer.settle()
    layer.sums, layer.index = sums, index
    layer.mode = Mode.QUERIES if sums is None else Mode.STEP_SUMS
