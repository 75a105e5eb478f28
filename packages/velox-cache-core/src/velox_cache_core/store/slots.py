"""Slot storage shared by every policy: keys, values and true positions per KV head.

A layer's retained tokens live in ``S`` slots per (batch row, KV head). Slot order carries no
meaning (softmax is permutation invariant and masks are built from positions), so a decode step
can write the newest token over the slot freed by the previous eviction instead of compacting.
When that happens the store holds ``budget + 1`` slots of which one, ``free``, is dead.

While a cache grows one token at a time (decode before the budget is reached, or a policy that
keeps every decoded token), copying every slot into a new array per step costs a copy of the
whole store per token. A store can instead sit in the first ``S`` rows of larger buffers (a
:class:`Reserve`): the next token is written into row ``S`` in place and the slots become the
first ``S + 1`` rows, as mlx-lm's ``KVCache`` grows in steps. The reserved rows are counted in
:attr:`KVSlots.n_held` (what the store's bytes report).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.store import rows as store_rows
from velox_cache_core.store.rows import Rows

# field metadata: working storage that saving and equality ignore (stored_fields)
TRANSIENT = "velox_transient"


def stored_fields(value: Any) -> tuple[dataclasses.Field[Any], ...]:
    """The fields of a dataclass (or dataclass type) that make up its content: every field
    but working storage such as :attr:`KVSlots.reserve`, which saving and equality ignore."""
    return tuple(f for f in dataclasses.fields(value) if not f.metadata.get(TRANSIENT))


@dataclass(frozen=True)
class Reserve:
    """Buffers whose first rows are a store's slots: keys/values ``[B, H_kv, R, D]``, positions
    int32 ``[B, H_kv, R]`` with ``R >= S``. ``view`` is the keys array the store was made with:
    a store whose keys are not that array (rebuilt, tied, compacted) does not own the buffers."""

    keys: Rows
    values: Rows
    positions: mx.array
    view: Rows

    @property
    def rows(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True)
class KVSlots:
    """Retained keys/values of one layer.

    keys, values: ``[B, H_kv, S, D]`` (values ``D_v`` wide), full precision or quantized
    (:class:`~velox_cache_core.store.token_rows.QRows`); positions: int32 ``[B, H_kv, S]`` absolute
    positions; free: int32 ``[B, H_kv]`` index of the dead slot in each row, or ``None`` when
    all ``S`` slots hold live tokens.
    """

    keys: Rows
    values: Rows
    positions: mx.array
    free: mx.array | None = None
    # buffers the slots are the first rows of, with room for more tokens (see the module doc)
    reserve: Reserve | None = field(
        default=None, compare=False, repr=False, metadata={TRANSIENT: True}
    )

    @classmethod
    def empty_like(cls, keys: Rows, values: Rows) -> KVSlots:
        """Zero-row store with the batch, head and feature shape of ``keys``/``values``."""
        B, H, _, _ = keys.shape

        def empty(a: mx.array) -> mx.array:
            # new zero-row arrays, not a slice: a view would keep ``keys``' buffer alive
            return mx.zeros((B, H, 0, *a.shape[3:]), dtype=a.dtype)

        return cls(
            keys=store_rows.apply(keys, empty),
            values=store_rows.apply(values, empty),
            positions=mx.zeros((B, H, 0), dtype=mx.int32),
        )

    @property
    def n_slots(self) -> int:
        return int(self.keys.shape[2])

    @property
    def n_held(self) -> int:
        """Rows held per (batch row, KV head): the slots (a dead one included) plus any
        reserved rows after them."""
        room = self._room()
        return self.n_slots if room is None else room.rows

    def _room(self) -> Reserve | None:
        """The store's reserve, if it owns one (no dead slot, keys made from the buffers)."""
        room = self.reserve
        if room is None or self.free is not None or room.view is not self.keys:
            return None
        return room

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more rows fit in the store's reserved rows (written in place)."""
        room = self._room()
        return room is not None and self.n_slots + n <= room.rows

    @property
    def n_kept(self) -> int:
        """Live tokens per (batch row, KV head)."""
        return self.n_slots - (0 if self.free is None else 1)

    def arrays(self) -> list[mx.array]:
        """Every array the store holds (for ``mx.eval`` and serialisation)."""
        out = [*store_rows.arrays(self.keys), *store_rows.arrays(self.values), self.positions]
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
            keys=store_rows.take(self.keys, idx),
            values=store_rows.take(self.values, idx),
            positions=mx.take_along_axis(self.positions, idx, axis=2),
        )

    def head(self, n: int) -> KVSlots:
        """The first ``n`` slots (a store without dead slot), keeping the reserve: the rows
        after them become reserved rows again."""
        room = self._room()
        keys = self.keys[:, :, :n]
        reserve = None if room is None else replace(room, view=keys)
        return KVSlots(keys, self.values[:, :, :n], self.positions[:, :, :n], None, reserve)

    def append(self, keys: Rows, values: Rows, positions: mx.array, *, reserve: int = 0) -> KVSlots:
        """Concatenate new tokens after the live ones (``retained + new`` order).

        Into the reserved rows, in place, when the store owns enough of them; otherwise by
        copying, then with ``reserve`` more rows set aside for the appends that follow.
        """
        B, H = self.positions.shape[:2]
        L = int(keys.shape[2])
        positions = mx.broadcast_to(positions.astype(mx.int32), (B, H, L))
        room = self._room()
        n = self.n_slots + L
        if room is not None and n <= room.rows:
            at = mx.array([self.n_slots])

            def put(a: mx.array, b: mx.array) -> mx.array:
                return mx.slice_update(a, b, at, (2,))

            return KVSlots.in_reserve(
                store_rows.write(room.keys, keys, put),
                store_rows.write(room.values, values, put),
                put(room.positions, positions),
                n,
            )
        live = self.compact()
        keys = store_rows.concat([live.keys, keys], axis=2)
        values = store_rows.concat([live.values, values], axis=2)
        room_rows = [mx.zeros((B, H, reserve), dtype=mx.int32)] if reserve > 0 else []
        positions = mx.concatenate([live.positions, positions, *room_rows], axis=2)
        if reserve <= 0:
            return KVSlots(keys, values, positions)
        return KVSlots.in_reserve(
            store_rows.pad(keys, reserve), store_rows.pad(values, reserve), positions, n
        )

    @classmethod
    def in_reserve(cls, keys: Rows, values: Rows, positions: mx.array, n: int) -> KVSlots:
        """The store of the first ``n`` rows of these buffers (``[B, H_kv, R, *]``), owning
        them: appends write into the rows after them in place."""
        view = keys[:, :, :n]
        reserve = Reserve(keys, values, positions, view)
        return cls(view, values[:, :, :n], positions[:, :, :n], None, reserve)

    def write_free(self, keys: Rows, values: Rows, position: int | mx.array) -> KVSlots:
        """Write one new token (keys ``[B, H_kv, 1, D]``, values ``[B, H_kv, 1, D_v]``) into the
        dead slot, in place; ``position``: its position (an int or a 0-d array), or int ``[B]``
        one per row."""
        assert self.free is not None
        B, H = self.positions.shape[:2]
        row = self.free[:, :, None]
        if isinstance(position, mx.array) and position.ndim == 0:  # one op, not three
            pos = mx.broadcast_to(position.astype(mx.int32), (B, H, 1))
        elif isinstance(position, mx.array):
            pos = mx.broadcast_to(position.astype(mx.int32).reshape(B, 1, 1), (B, H, 1))
        else:
            pos = mx.full((B, H, 1), position, dtype=mx.int32)
        return KVSlots(
            keys=store_rows.put(self.keys, row, keys),
            values=store_rows.put(self.values, row, values),
            positions=mx.put_along_axis(self.positions, row, pos, axis=2),
        )

    def with_free(self, free: mx.array) -> KVSlots:
        """Mark slot ``free`` (int ``[B, H_kv or 1]``) of each row dead."""
        B, H = self.positions.shape[:2]
        free = mx.broadcast_to(free.astype(mx.int32), (B, H))
        return KVSlots(self.keys, self.values, self.positions, free)
