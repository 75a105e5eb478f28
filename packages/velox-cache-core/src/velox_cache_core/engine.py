"""What every policy's update does around its own rule: validate, lay out candidates, advance.

A call feeds ``L`` new tokens. Candidates are ``retained + new``: for a single token written
into the slot freed by the last eviction (in place), for a chunk appended after the live rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, TypeVar

import mlx.core as mx

from velox_cache_core.masks import expand_heads
from velox_cache_core.slots import KVSlots
from velox_cache_core.validation import (
    check_kv,
    check_queries,
    check_scale,
    require_finite,
)


class SlotState(Protocol):
    @property
    def slots(self) -> KVSlots | None: ...
    @property
    def offset(self) -> int: ...
    @property
    def tokens_seen(self) -> int: ...


S = TypeVar("S", bound=SlotState)


# Dataclass fields of a policy state that change as tokens arrive; every other field is a setting.
RUNNING_FIELDS = frozenset(
    {"slots", "history", "scores", "offset", "tokens_seen", "compressed", "scale"}
)


class SlotStateMixin:
    """Read-only views and accounting shared by every policy's state dataclass."""

    slots: KVSlots | None
    offset: int

    @property
    def settings(self) -> dict[str, Any]:
        """The policy's settings (every dataclass field that is not running state)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if f.name not in RUNNING_FIELDS
        }

    def _live(self) -> KVSlots | None:
        return None if self.slots is None else self.slots.compact()

    @property
    def keys(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained keys, rows in slot order (same as ``positions``)."""
        live = self._live()
        return None if live is None else live.keys

    @property
    def values(self) -> mx.array | None:
        """``[B, H_kv, n_kept, D]`` retained values."""
        live = self._live()
        return None if live is None else live.values

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
        """Retained tokens per (batch row, KV head)."""
        return self.n_kept

    @property
    def nbytes(self) -> int:
        """Bytes of the retained keys and values: ``B * H_kv * n_kept * D * 2 * itemsize``."""
        if self.slots is None:
            return 0
        B, H, _, D = self.slots.keys.shape
        return B * H * self.n_kept * D * 2 * self.slots.keys.dtype.size

    @property
    def compression_ratio(self) -> float:
        """Tokens seen per head over tokens kept (1.0 until something is evicted)."""
        return self.offset / self.n_kept if self.n_kept else 1.0


@dataclass(frozen=True)
class Step:
    """What one call's queries attend over, and the state after the call's evictions.

    keys, values: ``[B, H_kv, n, D]``; mask: ``None`` (all visible, only for ``L <= 1``) or bool
    ``[B, H, L, n]`` with ``H`` = 1 (same for all heads), ``H_q`` (per query head) or ``H_kv``
    (per KV head, no queries given: repeat each row over its query group).
    """

    keys: mx.array
    values: mx.array
    mask: mx.array | None
    state: Any


@dataclass(frozen=True)
class Call:
    """One validated update call. keys/values ``[B, H_kv, L, D]``, queries ``[B, H_q, L, D]``."""

    keys: mx.array
    values: mx.array
    queries: mx.array | None
    scale: float
    start: int  # absolute position of the first new token

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, H, L, D = self.keys.shape
        return B, H, L, D

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def probe(self, signal: str) -> mx.array:
        """``[B, H_p, L, D]``: the true queries (signal ``query``) or the new keys (``key``)."""
        if signal == "query":
            assert self.queries is not None
            return self.queries
        return self.keys

    def positions(self) -> mx.array:
        return mx.arange(self.start, self.start + self.length, dtype=mx.int32)

    def mask_heads(self, scope: str) -> int:
        """Heads of the returned mask: 1 for a layer-wide decision, else per (query) head."""
        if scope == "layer":
            return 1
        return self.keys.shape[1] if self.queries is None else self.queries.shape[1]

    def expand(self, mask: mx.array, scope: str) -> mx.array:
        return expand_heads(mask, self.keys.shape[0], self.mask_heads(scope))


def open_call(
    state: SlotState,
    state_type: type,
    keys: Any,
    values: Any,
    queries: Any,
    scale: Any,
    *,
    check_finite: bool,
) -> tuple[KVSlots, Call]:
    """Validate one update call against ``state``; nothing is computed or changed on error.

    Queries are required when the state scores with signal ``query`` (a state without a
    ``signal`` setting, like StreamingLLM's, only validates them if given).
    """
    if not isinstance(state, state_type):
        raise TypeError(f"state must be a {state_type.__name__}, got {type(state).__name__}")
    signal = getattr(state, "signal", None)
    slots = state.slots
    expect = None
    if slots is not None:
        B0, H0, _, D0 = slots.keys.shape
        expect = (B0, H0, D0)
    check_kv(keys, values, expect=expect, dtype=None if slots is None else slots.keys.dtype)
    if queries is not None:
        check_queries(queries, keys)
    elif signal == "query":
        raise ValueError("queries are required when signal='query' (or use signal='key')")
    scale = check_scale(scale, keys.shape[3])
    if check_finite:
        require_finite(keys=keys, values=values, queries=queries)
    if slots is None:
        slots = KVSlots.empty_like(keys, values)
    return slots, Call(keys, values, queries, scale, state.offset)


def decode_candidates(slots: KVSlots, call: Call) -> KVSlots:
    """``retained + new`` for a single token: into the dead slot if there is one, else appended."""
    if slots.free is not None:
        return slots.write_free(call.keys, call.values, call.start)
    return slots.append(call.keys, call.values, call.positions())


def chunk_candidates(slots: KVSlots, call: Call) -> KVSlots:
    """``retained + new`` for a chunk, in that order (the causal mask aligns bottom-right)."""
    return slots.append(call.keys, call.values, call.positions())


def advance(state: S, slots: KVSlots, call: Call, **changes: Any) -> S:
    """The state after ``call``: new slots, offset and token count, plus policy fields."""
    B, H, L, _ = call.shape
    return replace(  # type: ignore[type-var]
        state,
        slots=slots,
        offset=call.start + L,
        tokens_seen=state.tokens_seen + B * H * L,
        **changes,
    )
