"""Keys quantized per channel over groups of tokens, with a full-precision window (KIVI's keys).

Keys have outlier channels, so quantizing each row along its features (mlx-lm's layout) spends
a group's range on them: at 4 bits TOVA(512)'s perplexity on the embedded model rises 12%. KIVI
quantizes keys the other way, each feature over a group of ``G`` tokens, and keeps the newest
tokens at full precision until they fill a group. A group's tokens must then be stored
together, which eviction (one row freed anywhere, the next token written into it) breaks. So
:class:`KRows` separates the rows a store sees from where they are held:

- physical rows: ``P`` quantized rows, ``P / G`` groups, each feature of a group quantized over
  its ``G`` tokens (``mx.quantize`` along the token axis: ``packed`` uint32 ``[B, H, D, P * bits
  / 32]``, ``scales``/``biases`` ``[B, H, D, P / G]``), then ``W`` full-precision rows
  (``window`` ``[B, H, W, D]``), in the order they arrived;
- logical rows: ``where`` int32 ``[B, H, S]``, the physical row that each of the store's ``S``
  rows reads.

A row operation of the store (take, write in place, slice, pad, join) is done on ``where``
alone, so no held row is quantized again. A new row joins the window, and the window becomes a
group once it holds ``G`` rows. Rows nobody reads are dead. Once ``G`` of them have gathered,
the live rows are repacked in their physical order (arrival order, so a group holds tokens of
nearby positions, which is what makes per-channel ranges narrow): groups whose rows all survive
in place quantize again to the same codes, the others once more. The rows held are thus at most
``S`` live, fewer than ``G`` dead and the window's partial group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

LANES_REFUSED = (
    "kv_key_layout='channel' keeps each head's rows in its own groups; lanes (adaptive "
    "budgets: <policy>_allocation 'head' or 'global') share rows across heads. Use "
    "<policy>_allocation='uniform' or kv_key_layout='token'"
)


def row_index(index: Any) -> tuple[Any, ...]:
    """The parts of an index into quantized rows (batch, head, row axes); ``ValueError`` when
    it would reach their features, which are packed."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 3 or any(p is Ellipsis for p in parts):
        raise ValueError(
            "quantized rows (kv_bits) cannot be indexed along their features: the model "
            "transforms the cached keys or values itself; serve it with kv_bits=None"
        )
    return parts


def quantized_matmul(rows: Any, x: mx.array, transpose: bool) -> mx.array:
    """``x [B, H, G, L, *]`` times each head's packed ``rows`` (anything with ``packed``,
    ``scales``, ``biases``, ``bits`` and ``group_size`` in ``mx.quantize``'s layout)."""
    return mx.quantized_matmul(
        x,
        rows.packed[:, :, None],
        rows.scales[:, :, None],
        rows.biases[:, :, None],
        transpose=transpose,
        group_size=rows.group_size,
        bits=rows.bits,
    )


def padded(a: mx.array, n: int, axis: int = 2, at_end: bool = True) -> mx.array:
    """``a`` with ``n`` zero entries added after (or before) it along ``axis``."""
    shape = list(a.shape)
    shape[axis] = n
    zeros = mx.zeros(shape, dtype=a.dtype)
    return mx.concatenate([a, zeros] if at_end else [zeros, a], axis=axis)


@dataclass(frozen=True, eq=False)
class KRows:
    """Keys per channel over groups of ``group_size`` tokens plus a full-precision window; the
    store's ``S`` rows read physical rows through ``where`` (module docstring)."""

    packed: mx.array  # uint32 [B, H, D, P * bits / 32]
    scales: mx.array  # [B, H, D, P / G]
    biases: mx.array  # [B, H, D, P / G]
    window: mx.array  # [B, H, W, D], full precision
    where: mx.array  # int32 [B, H, S]: physical row of each logical row
    bits: int
    group_size: int

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, x: mx.array, bits: int, group_size: int, window: bool = False) -> KRows:
        """``x [B, H, L, D]`` held as whole groups of ``group_size`` tokens, then the rest in
        the window (all of it with ``window``: a call's new rows); logical row ``i`` is
        physical row ``i``."""
        B, H, L, D = (int(s) for s in x.shape)
        n = 0 if window else L // group_size * group_size
        if n:
            packed, scales, biases = mx.quantize(
                x[:, :, :n].swapaxes(2, 3), group_size=group_size, bits=bits
            )
        else:
            packed = mx.zeros((B, H, D, 0), dtype=mx.uint32)
            scales = biases = mx.zeros((B, H, D, 0), dtype=x.dtype)
        where = mx.broadcast_to(mx.arange(L, dtype=mx.int32), (B, H, L))
        return cls(packed, scales, biases, x[:, :, n:], where, bits, group_size)

    # -- what a store asks of rows ----------------------------------------------------------
    @property
    def n_quantized(self) -> int:
        """``P``: physical rows held in groups."""
        return int(self.packed.shape[3]) * 32 // self.bits

    @property
    def n_physical(self) -> int:
        return self.n_quantized + int(self.window.shape[2])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, S = (int(s) for s in self.where.shape)
        return B, H, S, int(self.window.shape[3])

    @property
    def dtype(self) -> mx.Dtype:
        return self.window.dtype

    @property
    def ndim(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes, scales, biases, the window and the row map."""
        return int(sum(a.nbytes for a in self.arrays()))

    def row_bytes(self) -> int:
        """Bytes one more quantized row costs in every (batch row, head), its map entry in."""
        B, H, _, D = self.shape
        per_row = D * self.bits / 8 + 2 * D / self.group_size * self.dtype.size + 4
        return int(B * H * per_row)

    def arrays(self) -> list[mx.array]:
        return [self.packed, self.scales, self.biases, self.window, self.where]

    def __iter__(self) -> Iterator[mx.array]:
        raise TypeError(
            "keys quantized per channel (kv_key_layout='channel') are read through the Velox "
            "attention hook; mlx-lm's quantized attention reads only kv_key_layout='token'"
        )

    def physical(self) -> mx.array:
        """Every physical row at full precision: ``[B, H, P + W, D]``."""
        if self.n_quantized == 0:
            return self.window
        groups = mx.dequantize(
            self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        ).swapaxes(2, 3)
        return mx.concatenate([groups.astype(self.dtype), self.window], axis=2)

    def dense(self) -> mx.array:
        """The store's rows dequantized: ``[B, H, S, D]`` (what attention sees)."""
        return mx.take_along_axis(self.physical(), self.where[..., None], axis=2)

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """``x [B, H, G, L, *]`` times each head's rows: ``x @ rows^T`` (``[B, H, G, L, S]``) or
        ``x @ rows`` (``[..., D]``), the groups read packed by ``mx.quantized_matmul``."""
        if not transpose:
            return x @ self.dense()[:, :, None].astype(x.dtype)
        parts = []
        if self.n_quantized:
            parts.append(quantized_matmul(self, x, transpose=False))
        if self.window.shape[2]:
            parts.append(x @ self.window[:, :, None].swapaxes(-1, -2).astype(x.dtype))
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        at = self.where[:, :, None, None, :]
        return mx.take_along_axis(
            logits, mx.broadcast_to(at, (*logits.shape[:-1], at.shape[-1])), -1
        )

    # -- row operations: on ``where`` only --------------------------------------------------
    def _with(self, where: mx.array, keep: int = 0) -> KRows:
        return KRows(
            self.packed, self.scales, self.biases, self.window, where, self.bits, self.group_size
        ).settled(keep)

    def map(self, fn: Callable[[mx.array], mx.array]) -> KRows:
        """A row operation (indexing only the row axis): done on the row map."""
        B, H, _ = self.where.shape
        where = fn(self.where[..., None])
        if where.ndim != 4 or tuple(where.shape[:2]) != (B, H):
            raise ValueError(LANES_REFUSED)
        return self._with(where[..., 0])

    def __getitem__(self, index: Any) -> KRows:
        """Index the batch, head and row axes (slices on the first two). A view: the physical
        rows are shared, not repacked (a store's first rows over its reserved ones)."""
        b, h, r = (*row_index(index), slice(None), slice(None), slice(None))[:3]
        if not isinstance(b, slice) or not isinstance(h, slice):
            raise TypeError("per-channel keys take slices on their batch and head axes")
        where = self.where[b, h, r]
        if where.ndim != 3:
            raise TypeError("per-channel keys take a slice or an index array on their rows")
        return self.rebuilt([*(a[b, h] for a in self.arrays()[:4]), where])

    def tie(self, others: list[mx.array]) -> KRows:
        """The same rows, evaluated only after ``others``."""
        return self.rebuilt([mx.depends([a], others)[0] for a in self.arrays()])

    def rebuilt(self, arrays: list[mx.array]) -> KRows:
        """Rows of this width from ``packed, scales, biases, window, where``."""
        packed, scales, biases, window, where = arrays
        return KRows(packed, scales, biases, window, where, self.bits, self.group_size)

    def pad(self, n: int, at_end: bool) -> KRows:
        """``n`` zero rows added after (or before) the store's rows, held in the window."""
        B, H, _, D = self.shape
        zeros = mx.zeros((B, H, n, D), dtype=self.dtype)
        added = KRows.from_dense(zeros, self.bits, self.group_size)
        return join([self, added] if at_end else [added, self], axis=2)

    def write(self, new: KRows, fn: Callable[[mx.array, mx.array], mx.array]) -> KRows:
        """``fn(rows, new rows)`` (a write along the row axis): ``new``'s physical rows join
        these, and ``fn`` is done on the two row maps."""
        if new.shape[:2] != self.shape[:2]:
            raise ValueError(LANES_REFUSED)
        merged, (mine, theirs) = _merge([self, new])
        where = fn(mine[..., None], theirs[..., None])
        if where.ndim != 4:
            raise ValueError("a write into per-channel keys may index only their rows")
        return merged._with(where[..., 0])

    # -- keeping the physical rows bounded --------------------------------------------------
    def settled(self, keep: int = 0) -> KRows:
        """Dead rows repacked once ``G`` of them have gathered, and the window's first ``G``
        rows quantized while it holds that many besides its last ``keep`` (a call's rows,
        just joined: they wait for the call's cut, so that only its survivors are
        quantized)."""
        S = int(self.where.shape[2])
        if self.n_physical - S >= self.group_size:
            return self.repacked()
        if int(self.window.shape[2]) - keep >= self.group_size:
            return self._flushed().settled(keep)
        return self

    def repacked(self) -> KRows:
        """The rows read, held again: groups none of whose rows died keep their codes and
        come first; the other live rows follow in physical order (arrival order, so nearby
        positions share a group), quantized into whole groups, and the last ``S mod G`` rows
        form the window."""
        B, H, S = (int(s) for s in self.where.shape)
        G, P, N = self.group_size, self.n_quantized, self.n_physical
        NG = P // G
        index = mx.arange(N, dtype=mx.int32)
        read = mx.put_along_axis(
            mx.zeros((B, H, N), dtype=mx.bool_), self.where, mx.array(True), axis=-1
        )
        intact = read[..., :P].reshape(B, H, NG, G).all(axis=-1)  # [B, H, NG]
        in_intact = mx.concatenate(
            [mx.repeat(intact, G, axis=-1), mx.zeros((B, H, N - P), dtype=mx.bool_)], axis=-1
        )
        key = mx.where(read, mx.where(in_intact, index, index + N), index + 2 * N)
        order = mx.argsort(key, axis=-1)[..., :S].astype(mx.int32)  # physical rows, new order
        new_index = mx.put_along_axis(
            mx.zeros((B, H, N), dtype=mx.int32),
            order,
            mx.broadcast_to(mx.arange(S, dtype=mx.int32), (B, H, S)),
            axis=-1,
        )
        where = mx.take_along_axis(new_index, self.where, axis=-1)
        fresh = KRows.from_dense(
            mx.take_along_axis(self.physical(), order[..., None], axis=2), self.bits, G
        )
        n_new = fresh.n_quantized // G
        if NG == 0 or n_new == 0:
            return fresh.rebuilt([*fresh.arrays()[:4], where])
        # intact groups first, in their order: their codes, scales and biases, as they were
        group_index = mx.arange(NG, dtype=mx.int32)
        first = mx.argsort(mx.where(intact, group_index, group_index + NG), axis=-1)
        first = first.astype(mx.int32)[..., :n_new]
        if n_new > NG:
            first = mx.concatenate([first, mx.zeros((B, H, n_new - NG), dtype=mx.int32)], axis=-1)
        keep = mx.arange(n_new) < intact.sum(axis=-1, keepdims=True)  # [B, H, n_new]

        def pick(old: mx.array, new: mx.array) -> mx.array:
            D, width = int(old.shape[2]), int(old.shape[3]) // NG
            old = old.reshape(B, H, D, NG, width)
            kept = mx.take_along_axis(old, first[:, :, None, :, None], axis=3)
            new = new.reshape(B, H, D, n_new, width)
            return mx.where(keep[:, :, None, :, None], kept, new).reshape(B, H, D, -1)

        return KRows(
            pick(self.packed, fresh.packed),
            pick(self.scales, fresh.scales.astype(self.scales.dtype)),
            pick(self.biases, fresh.biases.astype(self.biases.dtype)),
            fresh.window,
            where,
            self.bits,
            G,
        )

    def _flushed(self) -> KRows:
        """The window's first ``G`` rows as a new group (``where`` is unchanged: the rows keep
        their physical order)."""
        G = self.group_size
        packed, scales, biases = mx.quantize(
            self.window[:, :, :G].swapaxes(2, 3), group_size=G, bits=self.bits
        )
        return KRows(
            mx.concatenate([self.packed, packed], axis=3),
            mx.concatenate([self.scales, scales.astype(self.scales.dtype)], axis=3),
            mx.concatenate([self.biases, biases.astype(self.biases.dtype)], axis=3),
            self.window[:, :, G:],
            self.where,
            self.bits,
            self.group_size,
        )


def _merge(parts: list[KRows]) -> tuple[KRows, list[mx.array]]:
    """One physical store holding every part's rows (groups first, then windows, each in part
    order), and each part's row map into it."""
    first = parts[0]
    if any((p.bits, p.group_size) != (first.bits, first.group_size) for p in parts):
        raise TypeError("cannot join per-channel keys of different widths or group sizes")
    grouped = [p for p in parts if p.n_quantized] or [first]
    windowed = [p for p in parts if p.window.shape[2]] or [first]
    merged = KRows(
        _join([p.packed for p in grouped], axis=3),
        _join([p.scales for p in grouped], axis=3),
        _join([p.biases for p in grouped], axis=3),
        _join([p.window for p in windowed], axis=2),
        first.where,
        first.bits,
        first.group_size,
    )
    return merged, _maps(parts)


def _maps(parts: list[KRows]) -> list[mx.array]:
    """Each part's row map into the joined physical rows: its groups after the groups of the
    parts before it, its window rows after every group and the windows before it."""
    P = sum(p.n_quantized for p in parts)
    maps, q_at, w_at = [], 0, P
    for p in parts:
        nq, w = p.n_quantized, p.where
        maps.append(mx.where(w < nq, w + q_at, w - nq + w_at))
        q_at, w_at = q_at + nq, w_at + int(p.window.shape[2])
    return maps


def _join(arrays: list[mx.array], axis: int) -> mx.array:
    """``arrays`` concatenated; one array as it is (a decode step's new row joins only the
    window: the groups are not copied)."""
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=axis)


def join(parts: list[KRows], axis: int) -> KRows:
    """``parts`` joined along the row axis (2) or the batch axis (0)."""
    if axis == 2:
        merged, maps = _merge(parts)
        return merged._with(mx.concatenate(maps, axis=2), keep=int(parts[-1].window.shape[2]))
    if axis != 0:
        raise ValueError(f"per-channel keys join along the batch or row axis, not {axis}")
    # batch rows: every part padded to the same physical rows (zero groups, zero window rows)
    P = max(p.n_quantized for p in parts)
    W = max(int(p.window.shape[2]) for p in parts)
    grown = []
    for p in parts:
        nq, nw = p.n_quantized, int(p.window.shape[2])
        groups = (P - nq) // p.group_size
        grown.append(
            p.rebuilt(
                [
                    padded(p.packed, (P - nq) * p.bits // 32, 3),
                    padded(p.scales, groups, 3),
                    padded(p.biases, groups, 3),
                    padded(p.window, W - nw),
                    mx.where(p.where < nq, p.where, p.where - nq + P),
                ]
            )
        )
    return grown[0].rebuilt(
        [mx.concatenate(list(a), axis=0) for a in zip(*(p.arrays() for p in grown), strict=True)]
    )
