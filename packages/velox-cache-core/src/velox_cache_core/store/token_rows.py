"""Rows quantized per token, as MLX lays them out, and the :class:`Quant` spec of a store.

A store's keys and values are ``[B, H_kv, S, D]`` rows. With a :class:`Quant` (``kv_bits``,
``kv_group_size``) each row is quantized on its own, along its ``D`` features, exactly as
``mx.quantize`` does and as mlx-lm's ``QuantizedKVCache`` stores it: a :class:`QRows` holds

- ``packed``: uint32 ``[B, H_kv, S, D * bits / 32]``;
- ``scales`` and ``biases``: ``[B, H_kv, S, D / group_size]`` in the model's dtype.

Every row operation of the store (take, write in place, concatenate, slice, pad) applies the
same index to the three arrays, so evicting or overwriting a quantized row works like any
other row, and ``mx.quantized_matmul(q, *rows, transpose=True)`` runs on them directly.
:class:`QRows` implements the row protocol (:class:`~velox_cache_core.store.rows.RowStore`),
so the store's row functions (:mod:`velox_cache_core.store.rows`) handle it like the other
kinds. Keys may instead be quantized per channel (``Quant(keys="channel")``:
:class:`~velox_cache_core.store.channel_keys.KRows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_cache_core.store.channel_keys import KRows, padded, quantized_matmul, row_index

BITS = (1, 2, 3, 4, 5, 6, 8)  # what mx.quantize accepts (mlx 0.32)
GROUP_SIZES = (32, 64, 128)
KEY_LAYOUTS = ("token", "channel")


def check_member(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """``value`` must be one of ``choices`` (``ValueError``), and an int (not a bool) where
    they are ints (``TypeError``)."""
    ints = bool(choices) and isinstance(choices[0], int)
    if ints and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class Quant:
    """How a store quantizes its rows: ``bits`` per element, ``group_size`` elements per
    scale and bias. Values are always quantized per token (``group_size`` features, mlx-lm's
    ``QuantizedKVCache`` layout); keys too with ``keys="token"``, or with ``keys="channel"``
    per feature over groups of ``group_size`` tokens, the newest in a full-precision window
    (KIVI's keys, :class:`~velox_cache_core.store.channel_keys.KRows`)."""

    bits: int
    group_size: int = 64
    keys: str = "token"

    def __post_init__(self) -> None:
        check_member("kv_bits", self.bits, BITS)
        check_member("kv_group_size", self.group_size, GROUP_SIZES)
        check_member("kv_key_layout", self.keys, KEY_LAYOUTS)

    def check_width(self, width: int, what: str = "head_dim", off: str = "kv_bits") -> None:
        """``ValueError`` unless rows ``width`` features wide can be quantized in groups
        (the error names ``off``, the setting that turns this quantization off)."""
        if width % self.group_size:
            fits = ", ".join(str(g) for g in GROUP_SIZES if width % g == 0) or "none fits"
            raise ValueError(
                f"kv_group_size={self.group_size} must divide {what}={width} "
                f"(accepted here: {fits}); or use {off}=None"
            )

    def quantize(self, x: mx.array) -> QRows:
        """``[B, H, L, D]`` full-precision rows as :class:`QRows`."""
        self.check_width(int(x.shape[-1]), "the rows' width")
        if x.size == 0:  # MLX cannot quantize an empty array: empty arrays of the right shapes
            *lead, width = x.shape
            packed = mx.zeros((*lead, width * self.bits // 32), dtype=mx.uint32)
            scales = mx.zeros((*lead, width // self.group_size), dtype=x.dtype)
            return QRows(packed, scales, scales, self.bits, self.group_size)
        packed, scales, biases = mx.quantize(x, group_size=self.group_size, bits=self.bits)
        return QRows(packed, scales, biases, self.bits, self.group_size)

    def quantize_keys(self, x: mx.array) -> QRows | KRows:
        """``[B, H, L, D]`` keys in this spec's key layout. Per channel, a call's keys wait at
        full precision in the window until the store has cut them: its survivors are then
        quantized in groups (:meth:`KRows.settled`)."""
        if self.keys == "token":
            return self.quantize(x)
        self.check_width(int(x.shape[-1]), "the rows' width")
        return KRows.from_dense(x, self.bits, self.group_size, window=True)

    @classmethod
    def of(cls, bits: int | None, group_size: int = 64, keys: str = "token") -> Quant | None:
        """The spec for ``kv_bits``/``kv_group_size``/``kv_key_layout`` settings (``None``:
        full precision)."""
        return None if bits is None else cls(bits, group_size, keys)


@dataclass(frozen=True, eq=False)
class QRows:
    """Quantized rows: ``packed`` uint32 ``[B, H, S, D * bits / 32]``, ``scales``/``biases``
    ``[B, H, S, D / group_size]`` (``mx.quantize``'s layout). Iterating gives the three arrays,
    so ``mx.quantized_matmul(x, *rows, ...)`` and mlx-lm's quantized attention take it."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical ``(B, H, S, D)`` of the rows."""
        B, H, S, words = self.packed.shape
        return int(B), int(H), int(S), int(words) * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the rows dequantize to (the scales')."""
        return self.scales.dtype

    @property
    def ndim(self) -> int:
        return 4

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scales.nbytes + self.biases.nbytes)

    @property
    def quant(self) -> Quant:
        return Quant(self.bits, self.group_size)

    def arrays(self) -> list[mx.array]:
        return [self.packed, self.scales, self.biases]

    def __iter__(self) -> Iterator[mx.array]:
        return iter(self.arrays())

    def map(self, fn: Callable[[mx.array], mx.array]) -> QRows:
        """The same rows with ``fn`` applied to each of the three arrays (a row operation)."""
        return QRows(fn(self.packed), fn(self.scales), fn(self.biases), self.bits, self.group_size)

    def __getitem__(self, index: Any) -> QRows:
        """Index the batch, head and row axes (the feature axis is packed: it cannot be)."""
        row_index(index)
        return self.map(lambda a: a[index])

    def write(self, new: QRows, fn: Callable[[mx.array, mx.array], mx.array]) -> QRows:
        """``fn(array, new array)`` on each of the three arrays and ``new``'s counterpart (rows
        of the same format): a write of new rows into a store."""
        parts = zip(self.arrays(), new.arrays(), strict=True)
        packed, scales, biases = (fn(a, b) for a, b in parts)
        return QRows(packed, scales, biases, self.bits, self.group_size)

    def pad(self, n: int, at_end: bool) -> QRows:
        """``n`` zero rows added after (or before) the rows, in each of the three arrays."""
        return self.map(lambda a: padded(a, n, 2, at_end))

    def tie(self, others: list[mx.array]) -> QRows:
        """The same rows, evaluated only after ``others`` (``mx.depends`` on each array)."""
        return self.map(lambda a: mx.depends([a], others)[0])

    def row_bytes(self) -> int:
        """Bytes one row takes in every (batch row, head): ``B * H`` times the packed words'
        and the scales' and biases'."""
        B, H = int(self.packed.shape[0]), int(self.packed.shape[1])
        return B * H * sum(int(a.shape[3]) * a.dtype.size for a in self.arrays())

    def matmul(self, x: mx.array, transpose: bool) -> mx.array:
        """``x [B, H, G, L, *]`` times each head's rows, read packed (``mx.quantized_matmul``):
        ``x @ rows^T`` (``transpose``: ``[B, H, G, L, S]``) or ``x @ rows`` (``[..., D]``)."""
        return quantized_matmul(self, x, transpose)

    def dense(self) -> mx.array:
        """The rows dequantized: ``[B, H, S, D]`` in :attr:`dtype` (what attention sees)."""
        if self.packed.size == 0:
            return mx.zeros(self.shape, dtype=self.dtype)
        return mx.dequantize(
            self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )
