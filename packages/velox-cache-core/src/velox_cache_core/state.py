"""What every policy's layer state has: retained slots, counters, and settings vs running state.

A policy state is a frozen, keyword-only dataclass deriving from :class:`PolicyState`. Its own
fields are either settings (plain fields, validated by the policy's ``init``) or running state
(declared with :func:`running`): whatever changes as tokens arrive. Prompt-cache encoding, trim
and the settings view read that marking instead of a list of names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_cache_core.krows import KRows
from velox_cache_core.lanes import Lanes
from velox_cache_core.rows import concat, dense, row_bytes
from velox_cache_core.slots import KVSlots, stored_fields

_RUNNING = "velox_running"


def running(default: Any = None) -> Any:
    """A running-state field: state that changes as tokens arrive (not a setting)."""
    return dataclasses.field(default=default, metadata={_RUNNING: True})


def running_fields(state: Any) -> tuple[str, ...]:
    """Names of the running-state fields of a state (or state type)."""
    return tuple(f.name for f in dataclasses.fields(state) if f.metadata.get(_RUNNING))


def setting_fields(state: Any) -> tuple[str, ...]:
    """Names of the settings fields (every field that is not running state)."""
    return tuple(f.name for f in dataclasses.fields(state) if not f.metadata.get(_RUNNING))


def fresh(like: Any, **changes: Any) -> Any:
    """``dataclasses.replace(like, **changes)`` without re-running the frozen ``__init__``
    (a few microseconds per object: the decode fast path and trims build states once per layer
    per token). Only for changes of the fields' own types, taken from states the general path
    made, and for dataclasses that cache nothing in their ``__dict__``."""
    out = object.__new__(type(like))
    out.__dict__.update(like.__dict__)
    out.__dict__.update(changes)
    return out


@dataclass(frozen=True, kw_only=True)
class PolicyState:
    """Base of every policy's layer state.

    slots: the retained tokens (``None`` until the first call fixes ``B``, ``H_kv``, ``D`` and
    dtype); offset: tokens seen so far, the true position of the next token; tokens_seen:
    ``B * H_kv * L`` summed over calls.
    """

    slots: KVSlots | None = running()
    offset: int = running(0)
    tokens_seen: int = running(0)
    # rows an adaptive allocation kept, heads holding different counts (velox_cache_core.lanes);
    # ``slots`` then holds the rows that came after the cut
    lanes: Lanes | None = running()

    @property
    def settings(self) -> dict[str, Any]:
        """The policy's settings (every dataclass field that is not running state)."""
        return {name: getattr(self, name) for name in setting_fields(self)}

    def _live(self) -> KVSlots | None:
        """The retained rows per head: with :attr:`lanes`, every head's lane rows padded to
        the fullest head (zero rows at position :data:`~velox_cache_core.lanes.PAD`), then
        the rows after the cut (a view to read, never what attention runs over)."""
        if self.slots is None:
            return None
        live = self.slots.compact()
        if self.lanes is None:
            return live
        heads = self.lanes.per_head(int(live.positions.shape[1]))
        return KVSlots(
            keys=concat([heads.keys, dense(live.keys)], axis=2),
            values=concat([heads.values, dense(live.values)], axis=2),
            positions=mx.concatenate([heads.positions, live.positions], axis=2),
        )

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys, rows in slot order (same as ``positions``);
        dequantized when the store holds quantized rows; with :attr:`lanes`, each head padded
        as :meth:`_live` says."""
        live = self._live()
        return None if live is None else dense(live.keys)

    @property
    def values(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained values (dequantized when quantized)."""
        live = self._live()
        return None if live is None else dense(live.values)

    @property
    def positions(self) -> mx.array | None:
        """int32 ``[B, H_kv, n_kept]`` absolute positions of the retained rows."""
        live = self._live()
        return None if live is None else live.positions

    @property
    def n_kept(self) -> int:
        return 0 if self.slots is None else self.slots.n_kept

    @property
    def tokens_kept(self) -> int:
        """Retained tokens per (batch row, KV head), averaged over the heads when an adaptive
        allocation gave them different counts (:attr:`lanes`)."""
        if self.lanes is None or self.slots is None:
            return self.n_kept
        heads = int(self.slots.positions.shape[1])
        rows = self.lanes.n_lanes * self.lanes.width - (0 if self.lanes.free is None else heads)
        return self.n_kept + rows // heads

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values the state holds: the :attr:`lanes` rows, if any, and
        ``n_held`` rows of keys and values per (batch row, KV head), where ``n_held``
        (:attr:`KVSlots.n_held`) is the kept rows plus the dead slot a decode step leaves and
        the rows a growing store reserves. A row is ``(D + D_v) * itemsize`` bytes at full
        precision; quantized, its packed words plus its scales and biases
        (:func:`~velox_cache_core.rows.row_bytes`)."""
        if self.slots is None:
            return 0
        lanes = 0 if self.lanes is None else self.lanes.nbytes
        keys = self.slots.keys
        if isinstance(keys, KRows):  # groups, window and row map: what the arrays hold
            room = self.slots.reserve
            if room is not None and self.slots.n_held > self.slots.n_slots:
                keys = room.keys  # a growing store: its reserved rows are held too
            values = self.slots.n_held * row_bytes(self.slots.values)
            return keys.nbytes + values + lanes
        per_row = row_bytes(self.slots.keys) + row_bytes(self.slots.values)
        return self.slots.n_held * per_row + lanes

    @property
    def held_nbytes(self) -> int:
        """Every byte the state holds: ``nbytes``, the positions of the rows held and the dead
        slot's index, and the policy's running arrays (H2O's scores, MorphKV's probe rows)."""
        total = self.nbytes
        if self.slots is not None:
            B, H = self.slots.positions.shape[:2]
            total += B * H * self.slots.n_held * self.slots.positions.dtype.size
            total += 0 if self.slots.free is None else int(self.slots.free.nbytes)
        if self.lanes is not None:  # their keys and values are in nbytes already
            total += int(self.lanes.positions.nbytes) + int(self.lanes.owner.nbytes)
        for name in running_fields(self):
            if name not in ("slots", "lanes"):
                total += arrays_nbytes(getattr(self, name))
        return total

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per head over tokens kept (1.0 until something is evicted)."""
        kept = self.tokens_kept
        return self.offset / kept if kept else 1.0


def arrays_nbytes(value: Any) -> int:
    """Bytes of every array in ``value``: an array, a dataclass of arrays (its stored
    fields), or tuples, lists and dicts of them; anything else counts 0."""
    if isinstance(value, mx.array):
        return int(value.nbytes)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(arrays_nbytes(getattr(value, f.name)) for f in stored_fields(value))
    if isinstance(value, (tuple, list)):
        return sum(arrays_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(arrays_nbytes(v) for v in value.values())
    return 0
