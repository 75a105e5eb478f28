"""What changes a :class:`velox_cache_core.layer.Layer`'s kept rows between calls: the prompt's
end and the cuts of a model-wide allocation or phase, pins, trims, restores and ties.

Each function is bound as a method of ``Layer`` (``layer.trim(n)``); a call in flight is
settled first. A call that fails (``ValueError``) leaves the layer as it was.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core import demoted, pins
from velox_cache_core.distributed import summing_over
from velox_cache_core.store import rows
from velox_cache_core.undo import UndoLog
from velox_cache_core.validation import check_int


def take_cut(layer: Any, state: Any) -> None:
    """Take ``state``, this layer cut by a model-wide allocation or a model-driven phase (the
    cut cannot be undone: the log is cleared)."""
    before, layer.state = layer.state, state
    demoted.cut(layer, before)
    forget_call(layer)
    if layer.log is not None:
        layer.log = layer.log.cleared()


def end_prompt_now(layer: Any, state: Any) -> Any:
    """``state`` with the prompt ended (a model-wide cut, or the policy's own prompt-end step,
    which clears the log: it cannot be undone)."""
    layer.state = state
    if layer._cut_globally("prompt_end"):
        return layer.state
    ended = layer.policy.end_prompt(state)
    if ended is not state and layer.log is not None:
        layer.log = layer.log.cleared()
    return ended


def end_prompt(layer: Any) -> None:
    """End the prompt now (a no-op for policies without a prompt-end step)."""
    layer.settle()
    before = layer.state
    layer.state = end_prompt_now(layer, before)
    demoted.cut(layer, before)
    forget_call(layer)


def forget_call(layer: Any) -> None:
    """Drop what the last call attended over: after a cut outside a forward pass it is the
    whole uncut context, which nothing reads any more (a layer sharing these keys reads them
    within the same pass)."""
    layer.fetched = layer.last = None


def release(layer: Any) -> None:
    """Drop what only a layer sharing this one's keys and values reads after a call (the
    call's ``retained + new`` rows and, with a tier, the tier it attended): a caller whose
    model shares no layer's rows calls it once a call is attended, so that between calls the
    layer holds its rows, tier and undo log, not copies of them."""
    layer.fetched = layer.last = layer.shared_tier = None


def pin(layer: Any, start: int, stop: int) -> None:
    """Never evict tokens ``[start, stop)`` (token indices, 0 = the sequence's first; in every
    row of a batch): seen ones must all still be kept, future ones are kept as they come. They
    count in the budget; ``ValueError`` and no change when they do not fit
    (:mod:`velox_cache_core.pins`)."""
    layer.settle()
    layer.state = pins.pin(layer.policy, layer.state, start, stop)


def trimmable_tokens(layer: Any) -> int:
    """With a demoted tier: how many of the last tokens :meth:`trim` takes back now (within the
    last call); without one, the undo log's reach."""
    if layer.demote is not None:
        return demoted.reach(layer)
    return 0 if layer.log is None else int(layer.log.tokens)


def trim(layer: Any, n: int) -> None:
    """Forget the last ``n`` tokens exactly; ``ValueError`` and no change when the undo log
    does not reach back ``n`` tokens (or there is none). Pinned spans stay pinned. A
    decoding layer takes back decode steps in place (``trim`` of
    :mod:`velox_cache_core.decode`'s stores), without leaving the decode path."""
    hot = layer.hot
    if hot is not None and n.__class__ is int and n >= 0 and hot.trim(n):
        return
    layer.settle()
    name = layer.policy.name
    if layer.log is None:
        raise ValueError(f"cannot trim a {name} cache: it keeps no undo log (trim_window=0)")
    if layer.state.holds_prompt:
        raise ValueError(
            f"cannot trim a {name} cache that still holds its prompt for the "
            f"allocation={layer.state.allocation!r} cut, which comes with the first "
            "single-token call: speculative decoding (mlx-lm's verifies drafts in chunks) "
            "never makes one, so the cache would grow without bound; use "
            "allocation='uniform' with a draft model"
        )
    if layer.demote is not None:  # within the last call (velox_cache_core.demoted)
        check_int("n", n, minimum=0)
        demoted.trim(layer, n)
        return
    with summing_over(layer.group):
        layer.state, layer.log = layer.policy.trim(layer.state, layer.log, n)


def restore(layer: Any, state: Any, log: UndoLog | None) -> None:
    """Take ``state`` and ``log`` as this layer's (a row unpacked from a batch, a loaded prompt
    cache); nothing stays pending."""
    layer.state, layer.log = state, log
    layer.tier_undo = layer.pending = layer.phase = None
    forget_call(layer)
    layer.stepped = []


def tie(layer: Any, value: mx.array) -> None:
    """Tie ``value`` to the stored keys without changing them (pipeline-parallel sends)."""
    layer.settle()
    slots = layer.state.slots
    if slots is None:
        return
    tied = rows.tie(slots.keys, [value])
    layer.state = replace(layer.state, slots=replace(slots, keys=tied))
