"""Adaptive shares of a budget, held as lanes: how many rows each head keeps under ``head``
(AdaKV) and ``global`` allocation, and the cuts that give them.

Shares are decided once (:func:`shares`, at the cut): every head keeps at least ``floor`` rows
(its protected rows among them), the rest of the layer's total goes to the highest scores
across its heads, and the counts are rounded to whole lanes (largest remainders), never past
the total. Under ``global`` the layers' totals come first (:func:`global_totals`, one
threshold over every head of every layer). The rows themselves, and attention over them, are
the store's (:mod:`velox_cache_core.lanes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import mlx.core as mx

from velox_cache_core.declarations import PolicyState, running
from velox_cache_core.lanes import Lanes, cut, ranks, victims
from velox_cache_core.store.slots import KVSlots

ALLOCATIONS = ("uniform", "head", "global")


UNLINKED = (
    "allocation='global' cuts every layer of the model at once by one threshold, and this "
    "{name} layer is not linked to the others: build the caches with velox_mlx_lm's "
    "KVCacheBuilder.for_model (or load them with velox_mlx_lm.load_prompt_cache), or link "
    "the layers with velox_cache_core.model_shares.ModelShares"
)


FLOOR = 0.2  # a head's least share, as a fraction of the uniform one (AdaKV's floor)
LANES_PER_SHARE = 8  # lanes in a uniform share: a lane is budget // 8 rows


def lane_width(budget: int) -> int:
    """Rows per lane for a per-head ``budget``: an eighth of the uniform share (at least 1)."""
    return max(1, budget // LANES_PER_SHARE)


def floor_rows(budget: int, floor: float, protected: int, width: int) -> int:
    """A head's least rows: ``floor`` of its uniform share, at least its ``protected`` rows,
    rounded up to whole lanes."""
    least = max(math.ceil(floor * budget), protected, 1)
    return width * math.ceil(least / width)


def least_rows(budget: int, floor: float, protected: Iterable[mx.array], spare: int = 0) -> int:
    """A head's least rows (:func:`floor_rows`, lanes of :func:`lane_width` ``(budget)``) when
    a head holds at most the most ``protected`` rows (bool ``[B, H, n]``, one array per layer)
    plus ``spare``."""
    held = max(int(p.astype(mx.int32).sum(axis=-1).max().item()) for p in protected)  # type: ignore[arg-type]
    return floor_rows(budget, floor, held + spare, lane_width(budget))


def _contested(scores: mx.array, positions: mx.array, protected: mx.array, least: int) -> mx.array:
    """float32 ``[B, H, n]``: the scores of the rows past each head's ``least`` best (protected
    ones ``inf``), ``-inf`` for the rows within them (kept anyway)."""
    rank = ranks(scores, positions, protected)
    w = mx.where(protected, mx.inf, scores.astype(mx.float32))
    return mx.where(rank >= least, w, -mx.inf)


def shares(
    scores: mx.array,
    positions: mx.array,
    protected: mx.array,
    total: int,
    least: int,
    width: int,
) -> list[list[int]]:
    """Rows each head keeps (int ``[B, H]``, whole lanes of ``width``): ``least`` rows per
    head first (its protected rows, then its best), then the rest of ``total`` to the highest
    ``scores`` across the heads (ties lost by the oldest, then by the lower head), rounded to
    whole lanes by largest remainders. No head gets more than its ``n`` rows (rounded down to
    lanes); the counts sum to at most ``total``.

    scores: float ``[B, H, n]``; positions: int ``[B, H, n]``; protected: bool ``[B, H, n]``.
    """
    B, H, n = scores.shape
    cap = width * (n // width)
    total = min(total, H * cap)
    least = min(least, width * (total // H // width))
    k = max(0, total - H * least)
    won: list[list[int]] = [[] for _ in range(B)]  # the head of every row won
    if k > 0:
        # One row of H * n candidates outside the floors; the best k win.
        w = _contested(scores, positions, protected, least).reshape(B, H * n)
        age = positions * H + mx.arange(H, dtype=mx.int32)[None, :, None]
        by_age = mx.argsort(age.reshape(B, H * n), axis=-1)
        ordered = mx.take_along_axis(w, by_age, axis=-1)
        best = mx.take_along_axis(by_age, mx.argsort(ordered, axis=-1)[:, H * n - k :], axis=-1)
        won = (best // n).tolist()  # type: ignore[assignment]
    return [
        _whole_lanes([min(least + row.count(h), cap) for h in range(H)], [cap] * H, width, total)
        for row in won
    ]


def _whole_lanes(raw: list[int], caps: list[int], width: int, total: int) -> list[int]:
    """``raw`` row counts rounded to whole lanes of ``width`` (each at most its ``caps``, a
    multiple of ``width``), summing to at most ``total``: each rounded down, then the lanes
    left of ``total`` handed out by largest remainder (ties: the lower index)."""
    out = [min(c, width * (r // width)) for r, c in zip(raw, caps, strict=True)]
    spare = total - sum(out)
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i)):
        if spare < width:
            break
        if out[i] + width <= caps[i]:
            out[i] += width
            spare -= width
    return out


def global_totals(
    scores: list[mx.array],
    positions: list[mx.array],
    protected: list[mx.array],
    budget: int,
    least: int,
    width: int,
) -> list[int]:
    """Rows each layer keeps under a model-wide allocation: every head's ``least`` rows,
    then the highest scores across every head of every layer (each layer's ``[1, H, n]``
    ``scores``), ``budget`` rows per head on average in all; each layer's total rounded to
    whole lanes of ``width`` (down, then the freed lanes handed back by largest remainder),
    so the model holds at most ``budget`` rows per head, and exactly that when the budget
    rows of the whole model fill whole lanes and no layer runs out of rows."""
    if not scores:
        raise ValueError("global_totals() needs the scores of at least one layer")
    if any(s.ndim != 3 or s.shape[0] != 1 for s in scores):
        raise ValueError("global_totals() takes [1, H_kv, n] scores (one sequence)")
    heads = [int(s.shape[1]) for s in scores]
    caps = [width * (int(s.shape[2]) // width) for s in scores]
    pools = [
        _contested(s, pos, prot, min(least, cap)).reshape(-1)
        for s, pos, prot, cap in zip(scores, positions, protected, caps, strict=True)
    ]
    floors = [min(least, c) * h for c, h in zip(caps, heads, strict=True)]
    pool = mx.concatenate(pools)
    k = max(0, budget * sum(heads) - sum(floors))
    k = min(k, int((pool > -mx.inf).sum().item()))  # type: ignore[arg-type]
    won = [0] * len(scores)
    if k > 0:
        ends = mx.array(list(accumulate(int(p.shape[0]) for p in pools)))
        best = mx.argsort(pool)[pool.shape[0] - k :]
        layer = (best[:, None] >= ends[None, :]).sum(axis=-1)  # the layer of every row won
        won = mx.stack([(layer == i).sum() for i in range(len(scores))]).tolist()  # type: ignore[assignment]
    raw = [f + int(e) for f, e in zip(floors, won, strict=True)]
    return _whole_lanes(raw, [h * c for h, c in zip(heads, caps, strict=True)], width, sum(raw))


def check_allocation(allocation: object, floor: object) -> None:
    """``allocation`` one of :data:`ALLOCATIONS`, ``0 <= floor <= 1`` (a float)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {list(ALLOCATIONS)}, got {allocation!r}")
    if isinstance(floor, bool) or not isinstance(floor, (int, float)):
        raise TypeError(f"allocation_floor must be a float in [0, 1], got {floor!r}")
    if not 0.0 <= float(floor) <= 1.0:
        raise ValueError(f"allocation_floor must be in [0, 1], got {floor!r}")


def allocation_fields(allocation: Any, floor: Any, scope: Any = "head") -> dict[str, Any]:
    """``allocation`` and ``allocation_floor`` checked (:func:`check_allocation`), as state
    fields: ``head``/``global`` share rows across KV heads, so they need scope ``head``."""
    check_allocation(allocation, floor)
    if allocation != "uniform" and scope != "head":
        raise ValueError(
            f"allocation={allocation!r} shares rows across KV heads: it needs scope='head' "
            f"(got scope={scope!r})"
        )
    return {"allocation": allocation, "allocation_floor": float(floor)}


@dataclass(frozen=True, kw_only=True)
class AllocationState(PolicyState):
    """What a state offering ``head``/``global`` allocation declares (TOVA, H2O, SnapKV,
    KVzip, Expected Attention): the two settings and the lanes, in place of
    :class:`~velox_cache_core.declarations.PolicyState`'s answers."""

    allocation: str = "uniform"
    allocation_floor: float = FLOOR
    lanes: Lanes | None = running()  # a head/global allocation's rows (PolicyState.lanes)


def allot(
    live: KVSlots,
    scores: mx.array,
    protected: mx.array,
    *,
    budget: int,
    floor: float,
    total: int | None = None,
    keep_scores: mx.array | None = None,
    spare: int = 0,
) -> Lanes:
    """``live`` (``[B, H, n]`` rows) cut to adaptive shares, as lanes of
    :func:`lane_width` ``(budget)``: ``total`` rows per batch row across the heads (default
    ``budget * H``: the uniform cut's bytes), every head at least ``floor`` of its uniform
    share and its ``protected`` rows (plus ``spare``), the rest by ``scores`` (float
    ``[B, H, n]``)."""
    H = int(live.positions.shape[1])
    width = lane_width(budget)
    least = least_rows(budget, floor, [protected], spare)
    total = budget * H if total is None else total
    counts = shares(scores, live.positions, protected, total, least, width)
    return cut(live, scores, protected, counts, width, keep_scores)


def cut_into_lanes(
    state: Any, live: KVSlots, scores: mx.array, protected: mx.array, total: int | None
) -> Any:
    """``state`` with its rows ``live`` cut into lanes by :func:`allot` (its ``budget`` and
    ``allocation_floor``, ``total`` rows), the slot store emptied for what comes after: the
    cut of a policy whose cut runs at its prompt end (SnapKV, KVzip)."""
    lanes = allot(
        live, scores, protected, budget=state.budget, floor=state.allocation_floor, total=total
    )
    return replace(state, slots=KVSlots.empty_like(live.keys, live.values), lanes=lanes)


def linked_total(state: Any, total: int | None, name: str) -> int | None:
    """``total`` (a layer's rows under a model-wide cut) for a cut about to share rows out:
    under ``allocation="global"`` it must come from the linked layers (``ValueError``
    :data:`UNLINKED` when a lone layer tries to cut by itself)."""
    if total is None and state.allocation == "global":
        raise ValueError(UNLINKED.format(name=name))
    return total


def cut_evicting(
    state: Any,
    live: KVSlots,
    scores: mx.array,
    protect: Callable[[mx.array], mx.array],
    /,
    *,
    name: str,
    keep_scores: bool,
    total: int | None,
    **changes: Any,
) -> Any:
    """``state`` with its held rows ``live`` cut into lanes by :func:`allot` for a policy that
    evicts at every decode step, the slot store emptied for what comes after and the running
    ``changes`` applied. Each head's share holds one dead row (its weakest kept row, where the
    next token goes, as the slot store's dead slot) and at least one row more than its
    protected ones (``protect(positions)``: bool, the rows no decision may evict).
    ``keep_scores``: the lanes carry ``scores`` on as their running scores (H2O's sums).
    ``total``: the layer's rows under ``global`` (see :func:`linked_total`). The arguments
    before ``name`` are positional only: a policy's running field may be called ``scores``."""
    lanes = allot(
        live,
        scores,
        protect(live.positions),
        budget=state.budget,
        floor=state.allocation_floor,
        total=linked_total(state, total, name),
        keep_scores=scores,
        spare=2,
    )
    assert lanes.scores is not None
    free = victims(lanes, lanes.scores, protect(lanes.positions), int(live.positions.shape[1]))
    lanes = replace(lanes, free=free, scores=lanes.scores if keep_scores else None)
    empty = KVSlots.empty_like(live.keys, live.values)
    return replace(state, slots=empty, lanes=lanes, **changes)
