"""Slot storage shared by every policy: keys, values and true positions per KV head.

A layer's retained tokens live in ``S`` slots per (batch row, KV head). Slot order carries no
meaning (softmax is permutation invariant and masks are built from positions), so a decode step
can write the newest token over the slot freed by the previous eviction instead of compacting.
When that happens the store holds ``budget + 1`` slots of which one, ``free``, is dead.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class KVSlots:
    """Retained keys/values of one layer.

    keys, values: ``[B, H_kv, S, D]``; positions: int32 ``[B, H_kv, S]`` absolute positions;
    free: int32 ``[B, H_kv]`` index of the dead slot in each row, or ``None`` when all ``S``
    slots hold live tokens.
    """

    keys: mx.array
    values: mx.array
    positions: mx.array
    free: mx.array | None = None

    @classmethod
    def empty_like(cls, keys: mx.array, values: mx.array) -> KVSlots:
        """Zero-row store with the batch, head and feature shape of ``keys``/``values``."""
        B, H, _, _ = keys.shape
        return cls(
            keys=keys[:, :, :0, :],
            values=values[:, :, :0, :],
            positions=mx.zeros((B, H, 0), dtype=mx.int32),
        )

    @property
    def n_slots(self) -> int:
        return int(self.keys.shape[2])

    @property
    def n_kept(self) -> int:
        """Live tokens per (batch row, KV head)."""
        return self.n_slots - (0 if self.free is None else 1)

    def arrays(self) -> list[mx.array]:
        """Every array the store holds (for ``mx.eval`` and serialisation)."""
        out = [self.keys, self.values, self.positions]
        return out if self.free is None else [*out, self.free]

    def live_index(self) -> mx.array | None:
        """int32 ``[B, H_kv, S - 1]`` indices of the live slots, or ``None`` if all are live."""
        if self.free is None:
            return None
        idx = mx.arange(self.n_slots - 1, dtype=mx.int32)
        return idx + (idx >= self.free[..., None]).astype(mx.int32)

    def compact(self) -> KVSlots:
        """The same tokens with the dead slot (if any) removed, slot order otherwise kept."""
        idx = self.live_index()
        return self if idx is None else self.take(idx)

    def take(self, idx: mx.array) -> KVSlots:
        """Rows ``idx`` (int ``[B, H_kv or 1, m]``) of every head, as a store without dead slot."""
        B, H = self.positions.shape[:2]
        idx = mx.broadcast_to(idx, (B, H, idx.shape[-1]))
        return KVSlots(
            keys=mx.take_along_axis(self.keys, idx[..., None], axis=2),
            values=mx.take_along_axis(self.values, idx[..., None], axis=2),
            positions=mx.take_along_axis(self.positions, idx, axis=2),
        )

    def append(self, keys: mx.array, values: mx.array, positions: mx.array) -> KVSlots:
        """Concatenate new tokens after the live ones (``retained + new`` order)."""
        live = self.compact()
        B, H = live.positions.shape[:2]
        positions = mx.broadcast_to(positions.astype(mx.int32), (B, H, positions.shape[-1]))
        return KVSlots(
            keys=mx.concatenate([live.keys, keys], axis=2),
            values=mx.concatenate([live.values, values], axis=2),
            positions=mx.concatenate([live.positions, positions], axis=2),
        )

    def write_free(self, keys: mx.array, values: mx.array, position: int) -> KVSlots:
        """Write one new token (keys/values ``[B, H_kv, 1, D]``) into the dead slot, in place."""
        assert self.free is not None
        B, H, _, D = self.keys.shape
        row = self.free[:, :, None]
        feat = mx.broadcast_to(row[..., None], (B, H, 1, D))
        pos = mx.full((B, H, 1), position, dtype=mx.int32)
        return KVSlots(
            keys=mx.put_along_axis(self.keys, feat, keys, axis=2),
            values=mx.put_along_axis(self.values, feat, values, axis=2),
            positions=mx.put_along_axis(self.positions, row, pos, axis=2),
        )

    def with_free(self, free: mx.array) -> KVSlots:
        """Mark slot ``free`` (int ``[B, H_kv or 1]``) of each row dead."""
        B, H = self.positions.shape[:2]
        free = mx.broadcast_to(free.astype(mx.int32), (B, H))
        return KVSlots(self.keys, self.values, self.positions, free)
