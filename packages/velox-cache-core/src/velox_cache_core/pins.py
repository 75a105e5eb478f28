"""Pinned spans: token ranges of a sequence that no policy evicts.

A span is ``[start, stop)`` in token indices (0 = the sequence's first token; the indices rows
carry as ``positions``). A state holds its spans as the running field ``pins``, int32
``[B, P, 2]`` with :data:`MAX_SPANS` spans per sequence, merged and disjoint, unused ones
``[0, 0)``; ``None`` when nothing is pinned. Every policy reads them where it reads its sinks
(:func:`velox_cache_core.selection.sinks`), so pinned rows are protected on every path the
sinks are: decode steps, chunks, prompt-end cuts, lanes, packed batches, trims and prompt files
(a running field is saved and packed like any other).

Pinned rows live among the policy's rows: they count in its ``budget`` and in the bytes. A pin
fits when the sinks, every pinned token (seen or still to come) and the rows the policy always
keeps besides them (:attr:`~velox_cache_core.declarations.Traits.reserved`) leave at least one
row to evict; a span whose tokens were already evicted cannot be pinned. Both are a
``ValueError``, and the state is left as it was.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core.lanes import PAD
from velox_cache_core.policy import Policy
from velox_cache_core.validation import check_int

MAX_SPANS = 4
"""Disjoint pinned spans a sequence may hold (a fixed shape, so batches pack and compiled
decode steps are traced once)."""


def spans(pins: mx.array | None) -> list[tuple[int, int]]:
    """The spans of a state's ``pins`` (the first row's; every row's are set together), sorted
    and non-empty."""
    if pins is None:
        return []
    rows: list[list[int]] = pins[0].tolist()  # type: ignore[assignment]
    return sorted((a, b) for a, b in rows if b > a)


def merged(found: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted disjoint spans covering ``found`` (overlapping or touching spans joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(found):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def count(found: list[tuple[int, int]], n_sink: int = 0) -> int:
    """Tokens the spans pin beyond the first ``n_sink`` (the sinks, protected anyway)."""
    return sum(max(0, b - max(a, n_sink)) for a, b in merged(found))


def seen_pinned(pins: mx.array | None, offset: int, row: int = 0) -> int:
    """Tokens of row ``row``'s pinned spans among its first ``offset`` (all of them kept)."""
    if pins is None:
        return 0
    found: list[list[int]] = pins[min(row, pins.shape[0] - 1)].tolist()  # type: ignore[assignment]
    return sum(max(0, min(b, offset) - a) for a, b in found if b > a)


def pin_room(policy: Policy, state: Any) -> int | None:
    """Most tokens beyond the sinks that ``state`` can pin: its budget less its sinks, the rows
    the policy always keeps besides (:attr:`~velox_cache_core.declarations.Traits.reserved`)
    and one row to evict; ``None`` for a policy without a budget (it evicts nothing)."""
    budget = policy.traits.budget(state)
    if budget is None:
        return None
    return budget - 1 - policy.traits.n_sink(state) - policy.traits.reserved(state)


def pin(policy: Policy, state: Any, start: int, stop: int) -> Any:
    """``state`` with tokens ``[start, stop)`` pinned in every row (joined with its spans).

    ``ValueError`` (and ``state`` unchanged) when the spans would not fit the policy's budget,
    exceed :data:`MAX_SPANS`, or cover a token already evicted from some head.
    """
    check_int("start", start, minimum=0)
    check_int("stop", stop, minimum=1)
    if stop <= start:
        raise ValueError(f"stop must be > start ({start}), got {stop}")
    found = merged([*spans(state.pins), (start, stop)])
    if len(found) > MAX_SPANS:
        raise ValueError(
            f"a sequence holds at most {MAX_SPANS} disjoint pinned spans; pinning "
            f"[{start}, {stop}) would make {len(found)}: {found}"
        )
    _check_fits(policy, state, found, start, stop)
    _check_present(policy, state, start, stop)
    batch = 1 if state.slots is None else int(state.slots.positions.shape[0])
    padded = [*found, *([(0, 0)] * (MAX_SPANS - len(found)))]  # int32 [batch, MAX_SPANS, 2]
    pins = mx.broadcast_to(mx.array(padded, dtype=mx.int32)[None], (batch, MAX_SPANS, 2))
    return replace(state, pins=pins)


def _check_fits(
    policy: Policy, state: Any, found: list[tuple[int, int]], start: int, stop: int
) -> None:
    room = pin_room(policy, state)
    if room is None:  # a policy without a budget evicts nothing a pin could lose
        return
    n_sink = policy.traits.n_sink(state)
    reserved = policy.traits.reserved(state)
    pinned = count(found, n_sink)
    if pinned > room:
        budget = policy.traits.budget(state)
        kept = f"{n_sink} sink{'' if n_sink == 1 else 's'}" + (
            f" and {reserved} rows it always keeps" if reserved else ""
        )
        raise ValueError(
            f"cannot pin [{start}, {stop}): {pinned} pinned tokens would not fit "
            f"{policy.name}'s budget of {budget} rows per head with {kept} and a row to "
            f"evict (at most {max(room, 0)} pinned tokens); raise the budget or pin less"
        )


def _check_present(policy: Policy, state: Any, start: int, stop: int) -> None:
    seen = min(stop, int(state.offset))
    if state.slots is None or seen <= start:
        return
    positions = state._live().positions
    inside = (positions >= start) & (positions < seen) & (positions < PAD)
    least = int(inside.astype(mx.int32).sum(axis=-1).min().item())
    if least < seen - start:
        raise ValueError(
            f"cannot pin [{start}, {stop}): {policy.name} already evicted "
            f"{seen - start - least} of its tokens seen so far from some head; pin a span "
            "before its tokens are fed (or while they are all still kept)"
        )
