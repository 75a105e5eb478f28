"""Lanes: the rows of KV heads that keep different numbers of rows, held without padding.

The slot store (:class:`~velox_cache_core.store.slots.KVSlots`) gives every head of a layer the same
number of rows. An adaptive allocation (AdaKV's per-head shares, KVzip's model-wide threshold)
gives heads different counts; padding every head to the fullest one would hold up to twice the
bytes the budget promises. Lanes hold exactly the rows kept: they are cut into *lanes* of
``W`` rows, every lane owned by one KV head, and a head with ``c`` rows owns ``c / W`` lanes
(shares are whole lanes). The arrays are ``[B, N, W, D]``: one lane per "head" slot of an
ordinary store, so a batched matmul per lane scores them as ordinary heads are scored.

Attention runs over the lanes and a uniform *tail* (the rows that came after the cut, an
ordinary store) at once: each lane's logits come from the queries of its owner (gathered per
lane, ``[B, N, G * L, D]``), and the softmax is normalised per head across its lanes and its
tail rows (one shared maximum per head, partial sums added up per head through a
``[B, H, N]`` membership matrix). Nothing is padded: the cost is the rows held plus
``O(H * N)`` per query row for the per-head sums.

How many rows each head keeps, and the cut that sets them out as lanes, are the allocation's
(:mod:`velox_cache_core.allocation.shares`); this module holds the lanes, writes and evicts
within them, and attends over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.scoring import exp
from velox_cache_core.selection import NO_POSITION
from velox_cache_core.store import rows as store_rows
from velox_cache_core.store.channel_keys import LANES_REFUSED, KRows
from velox_cache_core.store.rows import QUANTIZED, Rows
from velox_cache_core.store.slots import KVSlots


@dataclass(frozen=True)
class LaneRule:
    """How a policy that evicts at every decode step decides over lanes (the engine's lanes
    path, ``velox_cache_core.engine``); a policy declares one in its registry record.

    cut(state, call): at a single-token call, the state cut to lanes if it holds a prompt to
    share out (its ``allocation`` is not ``uniform``), else the same state.
    probe(state): what scores the rows by attention: ``"query"``, ``"key"`` or ``None``
    (the lanes' stored scores alone).
    protect(state, positions, newest): bool ``[B, N, W]``, the rows no step may evict (sinks,
    a recent window); ``newest``: the new token's position (int, or int ``[B, 1, 1]``).
    score(state, lanes, weights): (the scores the lowest of which goes, the running scores the
    lanes keep or ``None``), from the rows' attention ``weights`` ``[B, N, W]`` (``None`` when
    ``probe`` is).
    observe(state, call): optional; the running fields a call over lanes changes before its
    tokens are decided (Expected Attention's query window and refreshed statistics), as a
    dict for ``dataclasses.replace``.
    """

    cut: Callable[[Any, Any], Any]
    probe: Callable[[Any], str | None]
    protect: Callable[[Any, mx.array, Any], mx.array]
    score: Callable[[Any, Lanes, mx.array | None], tuple[mx.array, mx.array | None]]
    observe: Callable[[Any, Any], dict[str, Any]] | None = None


@dataclass(frozen=True)
class GlobalRule:
    """How a policy whose cut runs in one layer takes part in a model-wide (``global``)
    allocation: the model's layers are linked by a
    :class:`~velox_cache_core.model_shares.ModelShares`, which cuts them all at once by one
    threshold; a policy declares one in its registry record.

    pending(state): whether the state still awaits that cut (it holds its prompt).
    scores(state): ``(live, scores, protected)``: the rows the cut shares out
    (:class:`~velox_cache_core.store.slots.KVSlots`, ``[B, H, n]``), their float ``[B, H, n]``
    scores and the bool ``[B, H, n]`` rows no cut drops; ``None`` when there is nothing to cut (a
    prompt within ``budget``).
    cut(state, total): the state cut to ``total`` rows in its layer (``None``: nothing to cut;
    the policy goes on as with ``uniform``).
    spare: rows a head needs beyond its protected ones (2 for a policy that evicts at every
    step: its dead row and one that can go; 0 for one that appends).
    when: ``"prompt_end"`` or ``"first_token"``, when the layers are cut (see
    :mod:`velox_cache_core.model_shares`).
    """

    pending: Callable[[Any], bool]
    scores: Callable[[Any], tuple[KVSlots, mx.array, mx.array] | None]
    cut: Callable[[Any, int | None], Any]
    spare: int
    when: str


@dataclass(frozen=True)
class Lanes:
    """Rows kept by KV heads with different counts.

    keys ``[B, N, W, D]``, values ``[B, N, W, D_v]`` (full precision or
    :class:`~velox_cache_core.store.token_rows.QRows`), positions int32 ``[B, N, W]``, owner int32
    ``[B, N]``: the KV head each lane belongs to (a head's lanes in ascending order).

    For a policy that evicts at every decode step (TOVA, H2O, Expected Attention): ``free``
    int32 ``[B, H]``, each head's dead row (a flat index into the ``N * W`` rows, where the
    next token is written, as the slot store's dead slot), and ``scores`` float32 ``[B, N, W]``,
    the running score of each row when the policy keeps one (``None`` otherwise).
    """

    keys: Rows
    values: Rows
    positions: mx.array
    owner: mx.array
    free: mx.array | None = None
    scores: mx.array | None = None

    @property
    def n_lanes(self) -> int:
        return int(self.positions.shape[1])

    @property
    def width(self) -> int:
        return int(self.positions.shape[2])

    def arrays(self) -> list[mx.array]:
        rest = (self.positions, self.owner, self.free, self.scores)
        keys, values = store_rows.arrays(self.keys), store_rows.arrays(self.values)
        return [*keys, *values, *(a for a in rest if a is not None)]

    def member(self, heads: int) -> mx.array:
        """bool ``[B, H, N]``: lane ``n`` belongs to head ``h``."""
        return self.owner[:, None, :] == mx.arange(heads, dtype=mx.int32)[None, :, None]

    def row_member(self, heads: int) -> mx.array:
        """bool ``[B, H, N * W]``: row ``r`` (a flat index) belongs to head ``h``."""
        return mx.repeat(self.member(heads), self.width, axis=2)

    def per_lane(self, a: mx.array) -> mx.array:
        """Per-head ``a`` ``[B, H, ...]`` per lane, ``[B, N, ...]``: each lane its owner's."""
        at = self.owner.reshape(*self.owner.shape, *([1] * (a.ndim - 2)))
        return mx.take_along_axis(a, at, axis=1)

    def counts(self, heads: int) -> mx.array:
        """int32 ``[B, H]``: rows each head holds."""
        return self.member(heads).sum(axis=-1).astype(mx.int32) * self.width

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held (every lane's rows, nothing padded)."""
        # row_bytes is one row in every (batch row, lane); a lane holds ``width`` of them
        return self.width * (store_rows.row_bytes(self.keys) + store_rows.row_bytes(self.values))

    def per_head(self, heads: int) -> KVSlots:
        """The rows as an ordinary store, each head padded to the fullest one (keys and
        values zero, position :data:`PAD`): for reading and for tests, never for attention."""
        B, N, W = self.positions.shape
        cap = int(self.counts(heads).max().item())  # type: ignore[arg-type]
        # head h's rows: its lanes in order, then the pad row N * W up to the fullest head's
        flat = mx.where(self.row_member(heads), mx.arange(N * W), N * W)
        index = mx.sort(flat, axis=-1)[:, :, :cap].reshape(B, heads * cap)

        def gather(rows: mx.array, fill: int) -> mx.array:
            pad = mx.full((B, 1, W, *rows.shape[3:]), fill, dtype=rows.dtype)  # row N * W
            picked = _take(mx.concatenate([rows, pad], axis=1), index)
            return picked.reshape(B, heads, cap, *rows.shape[3:])

        keys, values = store_rows.dense(self.keys), store_rows.dense(self.values)
        live = self.positions
        if self.free is not None:  # a dead row is no row of the head's
            live = put_rows(live, self.free, mx.full(self.free.shape, PAD, dtype=live.dtype))
        positions = gather(live, PAD)
        return KVSlots(gather(keys, 0), gather(values, 0), positions.astype(mx.int32))


PAD = 2**30  # position of a pad row in :meth:`Lanes.per_head`: after every real position


def ranks(scores: mx.array, positions: mx.array, protected: mx.array) -> mx.array:
    """int32 ``[B, H, n]``: each row's rank in its head (0 best): protected rows first, then
    by score, ties lost by the oldest (the order :func:`~velox_cache_core.selection.
    highest_weights` keeps by)."""
    n = scores.shape[-1]
    by_age = mx.argsort(positions, axis=-1)
    w = mx.take_along_axis(mx.where(protected, mx.inf, scores), by_age, axis=-1)
    ascending = mx.take_along_axis(by_age, mx.argsort(w, axis=-1), axis=-1)
    rank = mx.zeros(scores.shape, dtype=mx.int32)
    worst_first = mx.broadcast_to(mx.arange(n - 1, -1, -1, dtype=mx.int32), scores.shape)
    return mx.put_along_axis(rank, ascending, worst_first, axis=-1)


def cut(
    live: KVSlots,
    scores: mx.array,
    protected: mx.array,
    counts: list[list[int]],
    width: int,
    keep_scores: mx.array | None = None,
) -> Lanes:
    """Each head's best ``counts[b, h]`` rows of ``live`` (protected first, by ``scores``,
    ties lost by the oldest), in slot order, as lanes of ``width``. Every batch row keeps the
    same total (``counts.sum(axis=1)`` equal). ``keep_scores`` (float ``[B, H, n]``), if
    given, become the lanes' running :attr:`Lanes.scores`."""
    if isinstance(live.keys, KRows):
        raise ValueError(LANES_REFUSED)
    B, H, n = live.positions.shape
    totals = {sum(row) for row in counts}
    shape_ok = len(counts) == B and all(len(row) == H for row in counts)
    if not shape_ok or any(c % width for row in counts for c in row) or len(totals) != 1:
        raise ValueError(
            f"counts must be [B, H] = {(B, H)} whole lanes of {width} with equal row totals"
        )
    rank = ranks(scores, live.positions, protected)
    keep = rank < mx.array(counts, dtype=mx.int32)[..., None]
    T = totals.pop()
    # kept rows first, head by head in slot order: flat index h * n + i
    flat = mx.arange(H * n, dtype=mx.int32).reshape(1, H, n)
    key = mx.where(keep, flat, H * n + flat).reshape(B, H * n)
    idx = mx.sort(key, axis=-1)[:, :T]  # [B, T], all kept (T of them per row)

    def gather(a: mx.array) -> mx.array:
        return _take(a, idx).reshape(B, T // width, width, *a.shape[3:])

    owner = (idx[:, ::width] // n).astype(mx.int32)
    return Lanes(
        keys=store_rows.apply(live.keys, gather),
        values=store_rows.apply(live.values, gather),
        positions=gather(live.positions),
        owner=owner,
        scores=None if keep_scores is None else gather(keep_scores.astype(mx.float32)),
    )


def victims(lanes: Lanes, scores: mx.array, protected: mx.array, heads: int) -> mx.array:
    """Each head's row to evict: int32 ``[B, H]`` flat indices into the ``N * W`` rows, the
    lowest of ``scores`` (float ``[B, N, W]``) among the head's rows that are not
    ``protected`` (bool ``[B, N, W]``), ties lost by the oldest position."""
    return _victims(scores, protected, lanes.positions, lanes.row_member(heads))


@mx.compile
def _victims(
    scores: mx.array, protected: mx.array, positions: mx.array, mine: mx.array
) -> mx.array:
    """:func:`victims` (``mine``: bool ``[B, H, N * W]``), compiled: one fused kernel per
    shape instead of a dozen ops built every step."""
    B, N, W = positions.shape
    scores, protected, positions = (
        a.reshape(B, 1, N * W) for a in (scores.astype(mx.float32), protected, positions)
    )
    w = mx.where(mine & ~protected, scores, mx.inf)
    tied = mine & (w == w.min(axis=-1, keepdims=True))
    age = mx.where(tied, positions, NO_POSITION)
    return mx.argmin(age, axis=-1).astype(mx.int32)


def write(lanes: Lanes, keys: Rows, values: Rows, position: int | mx.array) -> Lanes:
    """One new token per head (keys ``[B, H, 1, D]``, values ``[B, H, 1, D_v]``, at
    ``position``, an int or int ``[B]``) written into each head's dead row, in place; its
    running score (when the lanes keep scores) is 0 until the policy scores it. The result
    has no dead row."""
    assert lanes.free is not None
    B, H = lanes.free.shape
    if isinstance(position, mx.array):
        pos = mx.broadcast_to(position.astype(mx.int32).reshape(B, 1), (B, H))
    else:
        pos = mx.full((B, H), position, dtype=mx.int32)
    scores = lanes.scores
    if scores is not None:
        scores = put_rows(scores, lanes.free, mx.zeros((B, H), dtype=mx.float32))
    return _overwrite(lanes, lanes.free, KVSlots(keys, values, pos), free=None, scores=scores)


def rows_at(lanes: Lanes, idx: mx.array) -> KVSlots:
    """Row ``idx[b, h]`` of each head (int32 ``[B, H]`` flat indices into the ``N * W``
    rows): keys/values ``[B, H, 1, D]``, positions ``[B, H, 1]``."""

    def pick(a: mx.array) -> mx.array:
        return _take(a, idx)[:, :, None]

    keys, values = store_rows.apply(lanes.keys, pick), store_rows.apply(lanes.values, pick)
    return KVSlots(keys, values, pick(lanes.positions))


def unwrite(lanes: Lanes, free: mx.array, rows: KVSlots | None, scores: mx.array | None) -> Lanes:
    """:func:`write` taken back: ``free`` (int32 ``[B, H]``) the dead rows again, holding
    ``rows`` (what :func:`rows_at` read there before; ``None``: left as they are, dead rows'
    content is moot), and the running ``scores`` as they were."""
    if rows is None:
        return replace(lanes, free=free, scores=scores)
    return _overwrite(lanes, free, rows, free=free, scores=scores)


def _overwrite(
    lanes: Lanes, at: mx.array, rows: KVSlots, *, free: mx.array | None, scores: mx.array | None
) -> Lanes:
    """``lanes`` with row ``at[b, h]`` of each head (int32 ``[B, H]``) holding ``rows`` (one
    per head: keys ``[B, H, 1, D]``, positions ``[B, H]`` or ``[B, H, 1]``)."""

    def put(a: mx.array, new: mx.array) -> mx.array:
        return put_rows(a, at, new)

    return Lanes(
        keys=store_rows.write(lanes.keys, rows.keys, put),
        values=store_rows.write(lanes.values, rows.values, put),
        positions=put(lanes.positions, rows.positions),
        owner=lanes.owner,
        free=free,
        scores=scores,
    )


def _take(a: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` (int ``[B, K]``, flat indices into the ``N * W`` rows) of lane-shaped ``a``
    ``[B, N, W, ...]`` (or head-shaped ``[B, H, n, ...]``): ``[B, K, ...]``."""
    B, N, W, *tail = a.shape
    at = idx.reshape(*idx.shape, *([1] * len(tail)))
    return mx.take_along_axis(a.reshape(B, N * W, *tail), at, axis=1)


def put_rows(a: mx.array, idx: mx.array, new: mx.array) -> mx.array:
    """Lane-shaped ``a`` ``[B, N, W, ...]`` with row ``idx[b, h]`` (int32 ``[B, H]`` flat
    indices into the ``N * W`` rows, as :func:`rows_at` reads) replaced by ``new`` (one row
    per head), in place."""
    B, N, W, *tail = a.shape
    H = int(idx.shape[1])
    at = idx.reshape(B, H, *([1] * len(tail)))
    flat = mx.put_along_axis(a.reshape(B, N * W, *tail), at, new.reshape(B, H, *tail), axis=1)
    return flat.reshape(a.shape)


def _matmul(x: mx.array, rows: Rows, transpose: bool) -> mx.array:
    """``x [B, X, M, *]`` times each of ``rows``' ``X`` heads (or lanes): float32 logits
    ``[B, X, M, n]`` (``transpose``: ``x @ keys^T``) or outputs ``[B, X, M, D_v]``."""
    if isinstance(rows, QUANTIZED):
        out = rows.matmul(x[:, :, None].astype(rows.dtype), transpose=transpose)[:, :, 0]
    else:
        out = x.astype(rows.dtype) @ (rows.swapaxes(-1, -2) if transpose else rows)
    return out.astype(mx.float32)


def attend_weights(
    queries: mx.array,
    lanes: Lanes,
    keys: Rows,
    values: Rows,
    mask: mx.array | None,
    scale: float,
    sinks: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Attention of ``queries [B, H_q, L, D]`` over ``lanes`` (every lane row visible to every
    query: they precede the call) and the tail ``keys``/``values`` ``[B, H, T, D]`` under
    ``mask`` (bool ``[B, 1, H_q or H, L, T]``-like: ``[B, M, L, T]`` with ``M`` in
    ``{1, H_q, H}``, or ``None``: all visible). ``sinks``: per-query-head sink logits
    ``[H_q]`` (gpt-oss). Returns ``[B, H_q, L, D_v]`` in the queries' dtype, and the softmax
    weight of every lane row averaged over each KV head's query heads and the queries: float32
    ``[B, N, W]`` (TOVA's decision weights, per head)."""
    B, H_q, L, D = queries.shape
    H, T = int(keys.shape[1]), int(keys.shape[2])
    g = H_q // H
    M = g * L
    q = (queries * scale).reshape(B, H, M, D)
    lane_logits = _matmul(lanes.per_lane(q), lanes.keys, True)  # [B, N, M, W]
    lane_max = lane_logits.max(axis=-1)  # [B, N, M]
    member = lanes.member(H)  # [B, H, N]
    peak = mx.where(member[..., None], lane_max[:, None], -mx.inf).max(axis=2)  # [B, H, M]
    tail_logits = _matmul(q, keys, True) if T else None  # [B, H, M, T]
    visible = None
    if tail_logits is not None:
        if mask is not None:
            if mask.ndim == 2:  # [L, T]: the same for every row and head
                mask = mask[None, None]
            m = mx.broadcast_to(mask, (B, *mask.shape[1:]))
            per = g if m.shape[1] == H_q else 1  # one per query head, per KV head or for all
            m = m.reshape(B, m.shape[1] // per, per, L, T)
            visible = mx.broadcast_to(m, (B, H, g, L, T)).reshape(B, H, M, T)
            tail_logits = mx.where(visible, tail_logits, -mx.inf)
        peak = mx.maximum(peak, tail_logits.max(axis=-1))
    sink_logits = None
    if sinks is not None:
        sink_logits = mx.broadcast_to(
            sinks.astype(mx.float32).reshape(1, H, g, 1), (B, H, g, L)
        ).reshape(B, H, M)
        peak = mx.maximum(peak, sink_logits)
    p = exp(lane_logits - lanes.per_lane(peak)[..., None])  # [B, N, M, W]
    weights = member.astype(mx.float32)
    N = lanes.n_lanes
    total = weights @ p.sum(axis=-1)  # [B, H, M]
    Dv = int(values.shape[3])
    out = (weights @ _matmul(p, lanes.values, False).reshape(B, N, M * Dv)).reshape(B, H, M, Dv)
    if tail_logits is not None:
        pt = exp(tail_logits - peak[..., None])
        if visible is not None:
            pt = mx.where(visible, pt, 0.0)
        total = total + pt.sum(axis=-1)
        out = out + _matmul(pt, values, False)
    if sink_logits is not None:
        total = total + exp(sink_logits - peak)
    out = out / total[..., None]
    weights_per_row = (p / lanes.per_lane(total)[..., None]).mean(axis=2)  # [B, N, W]
    return out.reshape(B, H_q, L, Dv).astype(queries.dtype), weights_per_row
