"""Rows of keys or values as a store holds them, behind one row protocol.

A store's keys and values are ``[B, H_kv, S, D]`` rows of one of three kinds (:data:`Rows`):

- dense: an ``mx.array`` at full precision;
- quantized per token (:class:`~velox_cache_core.store.token_rows.QRows`, mlx-lm's
  ``QuantizedKVCache`` layout), keys or values;
- keys quantized per channel over groups of tokens (KIVI's keys,
  :class:`~velox_cache_core.store.channel_keys.KRows`).

The two quantized kinds implement :class:`RowStore`, the operations the engine, the undo
log, the lanes, batching and encoding call on rows. The functions here take any kind and
apply the same operation to a dense array, so every caller handles the three through one
path; :func:`dense` is the full-precision view the arithmetic reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, Union

import mlx.core as mx

from velox_cache_core.store.channel_keys import KRows, join, padded
from velox_cache_core.store.token_rows import QRows, Quant


class RowStore(Protocol):
    """What a store asks of rows held in a form other than one dense array (``[B, H, S, D]``
    logical rows). A *row operation* indexes only the batch, head and row axes."""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical ``(B, H, S, D)``."""
        ...

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the rows read as at full precision."""
        ...

    @property
    def ndim(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Bytes held (what the store's bytes report)."""
        ...

    def arrays(self) -> list[mx.array]:
        """The arrays behind the rows (for ``mx.eval``, ``mx.depends`` and saving)."""
        ...

    def __iter__(self) -> Iterator[mx.array]: ...

    def dense(self) -> mx.array:
        """The rows at full precision: ``[B, H, S, D]``."""
        ...

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """``x [B, H, G, L, *]`` times each head's rows: ``x @ rows^T`` (``[B, H, G, L, S]``)
        or ``x @ rows`` (``[B, H, G, L, D]``), read in the held form."""
        ...

    def map(self, fn: Callable[[mx.array], mx.array]) -> RowStore:
        """A row operation ``fn`` (written for one ``[B, H, S, W]`` array) on the rows."""
        ...

    def __getitem__(self, index: Any) -> RowStore:
        """Index the batch, head and row axes (never the features)."""
        ...

    def write(self, new: Any, fn: Callable[[mx.array, mx.array], mx.array]) -> RowStore:
        """``fn(rows, new rows)``, a write along the row axis, with ``new`` of the same kind
        and format (``[B, H, L, D]``)."""
        ...

    def pad(self, n: int, at_end: bool) -> RowStore:
        """``n`` zero rows added after (or before) the rows."""
        ...

    def tie(self, others: list[mx.array]) -> RowStore:
        """The same rows, evaluated only after ``others``."""
        ...

    def row_bytes(self) -> int:
        """Bytes one more row costs in every (batch row, head)."""
        ...


Rows = Union[mx.array, QRows, KRows]  # noqa: UP007 (a runtime alias read by isinstance users)
QUANTIZED = (QRows, KRows)
_KINDS: tuple[type[RowStore], ...] = QUANTIZED  # mypy checks both kinds against the protocol


def dense(rows: Rows) -> mx.array:
    """Full-precision ``[B, H, S, D]`` rows (unchanged when they are not quantized)."""
    return rows.dense() if isinstance(rows, QUANTIZED) else rows


def quant_of(rows: Rows) -> Quant | None:
    """The rows' quantization (``None``: full precision)."""
    if isinstance(rows, KRows):
        return Quant(rows.bits, rows.group_size, "channel")
    return rows.quant if isinstance(rows, QRows) else None


def apply(rows: Rows, fn: Callable[[mx.array], mx.array]) -> Rows:
    """A row operation (one that indexes only the batch, head and row axes) on either kind."""
    return rows.map(fn) if isinstance(rows, QUANTIZED) else fn(rows)


def arrays(rows: Rows) -> list[mx.array]:
    """The arrays behind ``rows`` (for ``mx.eval``, ``mx.depends`` and saving)."""
    return rows.arrays() if isinstance(rows, QUANTIZED) else [rows]


def concat(parts: Sequence[Rows], axis: int) -> Rows:
    """``parts`` joined along ``axis`` (0: batch, 2: rows); all of one kind and format."""
    first = parts[0]
    if isinstance(first, KRows):
        if not all(isinstance(p, KRows) for p in parts):
            raise TypeError("cannot join keys quantized per channel with other rows")
        return join(list(parts), axis)  # type: ignore[arg-type]
    if isinstance(first, QRows):
        qs = [_same_format(first, p) for p in parts]
        arrays = zip(*(q.arrays() for q in qs), strict=True)
        packed, scales, biases = (mx.concatenate(list(a), axis=axis) for a in arrays)
        return QRows(packed, scales, biases, first.bits, first.group_size)
    if any(isinstance(p, QUANTIZED) for p in parts):
        raise TypeError("cannot join quantized and full-precision rows")
    return mx.concatenate(list(parts), axis=axis)  # type: ignore[arg-type]


def _same_format(first: QRows, other: Rows) -> QRows:
    if not isinstance(other, QRows) or other.quant != first.quant:
        raise TypeError(f"cannot join rows quantized as {first.quant} with {quant_of(other)}")
    return other


def take(rows: Rows, idx: mx.array) -> Rows:
    """Rows ``idx`` (int ``[B, H, m]``) of each (batch row, head)."""
    return apply(rows, lambda a: mx.take_along_axis(a, idx[..., None], axis=2))


def write(rows: Rows, new: Rows, fn: Callable[[mx.array, mx.array], mx.array]) -> Rows:
    """``fn(array, new array)`` on each array of ``rows`` and its counterpart in ``new`` (the
    same kind and format): a write of new rows into a store."""
    if isinstance(rows, KRows):
        if not isinstance(new, KRows):
            raise TypeError(f"cannot write {quant_of(new)} rows into keys quantized per channel")
        return rows.write(new, fn)
    if isinstance(rows, QRows):
        return rows.write(_same_format(rows, new), fn)
    if isinstance(new, QUANTIZED):
        raise TypeError("cannot write quantized rows into full-precision ones")
    return fn(rows, new)


def put(rows: Rows, row: mx.array, new: Rows) -> Rows:
    """``rows`` with row ``row`` (int ``[B, H, 1]``) of each head replaced by ``new``
    (``[B, H, 1, *]``, same kind), in place where MLX can."""

    def one(a: mx.array, b: mx.array) -> mx.array:
        B, H, _, W = a.shape
        return mx.put_along_axis(a, mx.broadcast_to(row[..., None], (B, H, 1, W)), b, axis=2)

    return write(rows, new, one)


def pad(rows: Rows, n: int, at_end: bool = True) -> Rows:
    """``rows`` with ``n`` zero rows added after (or before) them."""
    return rows.pad(n, at_end) if isinstance(rows, QUANTIZED) else padded(rows, n, 2, at_end)


def tie(rows: Rows, others: list[mx.array]) -> Rows:
    """``rows`` unchanged, evaluated only after ``others`` (``mx.depends`` on each array)."""
    if isinstance(rows, QUANTIZED):
        return rows.tie(others)
    return mx.depends([rows], others)[0]


def row_bytes(rows: Rows) -> int:
    """Bytes one row takes in every (batch row, head): ``B * H * D * itemsize`` at full
    precision; quantized, what the kind holds per row (packed words, scales and biases, and
    for per-channel keys the row map's entry)."""
    if isinstance(rows, QUANTIZED):
        return rows.row_bytes()
    B, H = int(rows.shape[0]), int(rows.shape[1])
    return B * H * int(rows.shape[3]) * rows.dtype.size
