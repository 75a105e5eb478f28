"""A batch of single-sequence layers driven as one layer: what a batched cache needs.

Each row is its own :class:`~velox_cache_core.layer.Layer`, so row ``b`` keeps exactly what the
same sequence keeps alone (row equivalence). Padding is never stored: :meth:`LayerBatch.prepare`
says which tokens of the coming calls are real (right padding up to ``lengths``, or left
padding), :meth:`LayerBatch.lay_out` hands each row only its span, and
:meth:`LayerBatch.attend` attends each row over its own keys with its own mask.

Packed rows: while every row decodes one token per step and their slots are laid out alike (a
bounded policy's rows once each has evicted) or can be padded alike (rows below their budget),
the rows are held as one B-row core state (:func:`velox_cache_core.packed.pack`) and each step is
one engine call, not B. Anything else (a prefill, a row joining or leaving, a trim, reading a
row, padded rows about to reach their budget) unpacks them first: each row gets back exactly
the state and undo log it would have had alone.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import attend as attend_step
from velox_cache_core.batch import (
    attend_rows,
    check_compatible,
    check_index,
    check_single,
    row_signature,
)
from velox_cache_core.distributed import summing_over
from velox_cache_core.layer import Layer
from velox_cache_core.packed import Packed, can_pack, detach, pack, packed_update, unpack
from velox_cache_core.pins import seen_pinned
from velox_cache_core.store import rows as store_rows
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.validation import check_fits, check_kv


def _signature(layer: Layer) -> dict[str, Any]:
    """What rows of one batch share: policy, settings, trim window, group, and once fed,
    KV heads, head dim and dtype."""
    state = layer.view()
    return {
        **row_signature(state),
        "policy state": layer.policy.name,
        "trim_window": 0 if layer.log is None else layer.log.window,
        "group": id(layer.group) if layer.group is not None else None,
        "quant": layer.quant,
    }


def check_rows(rows: Sequence[Layer], what: str) -> None:
    """``ValueError`` naming what differs unless ``rows`` can share a batch (single-sequence
    layers of one policy with the same settings, trim window, group, heads and dtype)."""
    for i, row in enumerate(rows):
        if row.phase is not None:
            raise ValueError(f"{what}[{i}] is in its policy's scoring phase; finish it first")
        check_single(row.view(), f"{what}[{i}]")
    check_compatible([_signature(row) for row in rows], "row 0 and row {}")


def indices(batch_indices: Any, size: int) -> list[int]:
    if isinstance(batch_indices, mx.array):
        batch_indices = batch_indices.tolist()
    if isinstance(batch_indices, int):
        batch_indices = [batch_indices]
    return [check_index(i, size, "batch index") for i in batch_indices]


def _counts(name: str, value: Any, size: int) -> list[int]:
    if isinstance(value, mx.array):
        value = value.tolist()
    values = list(value)
    if len(values) != size:
        raise ValueError(f"{name} must have one entry per row ({size}), got {len(values)}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be ints >= 0, got {values}")
    return values


class LayerBatch:
    """``B`` sequences of one policy in one layer: ``rows[b]`` is row ``b``'s single-sequence
    :class:`~velox_cache_core.layer.Layer`. Calls must be attended (:meth:`attend`) with the
    queries: each row attends over its own candidates with its own mask."""

    def __init__(self, rows: list[Layer]) -> None:
        if not rows:
            raise ValueError("a batch needs at least one row")
        check_rows(rows, "rows")
        self._rows = rows
        self._packed: Packed | None = None  # the rows while they decode packed (module doc)
        self._packed_call: tuple[store_rows.Rows, store_rows.Rows] | None = None  # to attend
        self._pad_left = [0] * len(rows)  # padding tokens before each row's next real token
        self._real_left: list[int | None] = [None] * len(rows)  # real tokens until padding
        self._spans: list[tuple[int, int]] | None = None  # the call awaiting attend

    # -- packed rows (see the module doc) -------------------------------------------------------
    @property
    def rows(self) -> list[Layer]:
        """The rows' single-sequence layers (unpacked first when packed)."""
        self._unpack()
        return self._rows

    def _unpack(self) -> None:
        if self._packed_call is not None:
            raise RuntimeError("a packed decode step is waiting for attend()")
        if self._packed is None:
            return
        states, logs = unpack(self._packed)
        self._packed = None
        for row, state, log in zip(self._rows, states, logs, strict=True):
            row.restore(state, log)

    def _try_pack(self) -> bool:
        """Pack the rows for a decode step when they can be (see the module doc)."""
        if self._packed is not None:
            if self._packed.can_step():
                return True
            self._unpack()  # padded rows about to evict: each decides alone again
        rows = self._rows
        policy = rows[0].policy
        if not policy.packs_rows:  # most of what can_pack checks costs a loop
            return False
        group = rows[0].group
        if any(not row.quiet or row.group is not group for row in rows):
            return False
        if rows[0].demote is not None:
            return False  # each row's tier holds what that row evicted: unpacked
        states = [row.state for row in rows]
        if any(s.slots is not None and isinstance(s.slots.keys, KRows) for s in states):
            return False  # per-channel keys group as each row's own history goes: unpacked
        if not can_pack(policy, states):
            return False
        self._packed = pack(policy, states, [row.log for row in rows])
        return True

    def row_stats(self) -> list[dict[str, int]]:
        """Per row: ``tokens_seen``, ``tokens_kept``, ``pinned_tokens``, ``kv_bytes`` (keys and
        values held, as ``nbytes``) and ``cache_bytes`` (every byte the row holds, undo log
        included), read without unpacking packed rows (which share the packed arrays evenly)."""
        packed = self._packed
        if packed is None:
            return [_row_stats(row) for row in self._rows]
        B = len(self._rows)
        state = packed.state
        shared = int(state.held_nbytes) + (0 if packed.log is None else packed.log.nbytes)
        return [
            {
                "tokens_seen": offset,
                "tokens_kept": kept,
                "pinned_tokens": seen_pinned(state.pins, offset, b),
                "kv_bytes": int(state.nbytes) // B,
                "cache_bytes": shared // B + (0 if log is None else log.nbytes),
            }
            for b, (offset, kept, log) in enumerate(
                zip(packed.offsets, packed.tokens_kept, packed.logs, strict=True)
            )
        ]

    # -- reading --------------------------------------------------------------------------------
    @property
    def offsets(self) -> list[int]:
        """Each row's position of its next real token (less pending left padding, so that the
        padding's real successor is rotated to the right position)."""
        seen = self.tokens_seen
        return [o - pad for o, pad in zip(seen, self._pad_left, strict=True)]

    @property
    def tokens_kept(self) -> list[int]:
        """Retained tokens per row (per KV head)."""
        if self._packed is not None:
            return self._packed.tokens_kept
        return [int(row.view().tokens_kept) for row in self._rows]

    @property
    def tokens_seen(self) -> list[int]:
        if self._packed is not None:
            return list(self._packed.offsets)
        return [row.offset for row in self._rows]

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values the rows hold (as ``nbytes`` of each row; rows packed
        below their budget also hold the padding slots that align them)."""
        if self._packed is not None:
            return int(self._packed.state.nbytes)
        tiers = sum(0 if row.tier is None else row.tier.nbytes for row in self._rows)
        return sum(int(row.view().nbytes) for row in self._rows) + tiers

    @property
    def undo_nbytes(self) -> int:
        return sum(0 if row.log is None else row.log.nbytes for row in self.rows)

    def size(self) -> int:
        """The longest row's retained tokens."""
        if self._packed is not None:
            return int(self._packed.state.n_kept)
        return max(int(row.view().n_kept) for row in self._rows)

    def empty(self) -> bool:
        return self._packed is None and all(row.empty() for row in self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows_policy(self) -> Any:
        """The policy every row follows."""
        return self._rows[0].policy

    @property
    def layers(self) -> list[Layer]:
        """The rows' layers as held (read them only while :meth:`packed_arrays` is ``None``)."""
        return self._rows

    @property
    def packed(self) -> Packed | None:
        """The rows while held packed (one engine call per decode step), else ``None``."""
        return self._packed

    @property
    def pending(self) -> bool:
        """Whether a call waits for :meth:`attend`."""
        return self._spans is not None

    @property
    def padding(self) -> tuple[list[int], list[int | None]]:
        """(left padding still to come, real tokens until padding) per row."""
        return list(self._pad_left), list(self._real_left)

    @property
    def keys(self) -> mx.array | None:
        """Row 0's retained keys, or the packed rows' keys (what pipeline-parallel models tie
        their send to, every forward pass: reading them does not unpack)."""
        if self._packed is not None:
            return store_rows.dense(self._packed.state.slots.keys)
        return self._rows[0].view().keys

    def tie(self, value: mx.array) -> None:
        """Tie ``value`` to the stored keys without changing them (pipeline-parallel sends;
        packed rows stay packed)."""
        packed = self._packed
        if packed is None:
            self._rows[0].tie(value)
            return
        slots = packed.state.slots
        tied = replace(slots, keys=store_rows.tie(slots.keys, [value]))
        self._packed = replace(packed, state=replace(packed.state, slots=tied))

    # -- padding -----------------------------------------------------------------------------
    def prepare(
        self,
        *,
        left_padding: Any = None,
        lengths: Any = None,
        right_padding: Any = None,
    ) -> None:
        """Say which tokens of the coming calls are padding: ``left_padding[b]`` tokens before
        row ``b``'s next real ones, and (mlx-lm's right padding) ``lengths[b]`` real tokens
        after which row ``b``'s tokens are padding until :meth:`finalize`."""
        self._unpack()
        B = len(self._rows)
        pads = None if left_padding is None else _counts("left_padding", left_padding, B)
        real = None if lengths is None else _counts("lengths", lengths, B)
        if right_padding is not None:
            right = _counts("right_padding", right_padding, B)
            if real is None and any(right):
                raise ValueError("prepare(right_padding=...) needs lengths=... (real tokens)")
        if pads is not None:
            self._pad_left = [a + b for a, b in zip(self._pad_left, pads, strict=True)]
        if real is not None:
            self._real_left = list(real)

    def finalize(self) -> None:
        """End of a padded prompt: later calls are all real tokens again."""
        self._real_left = [None] * len(self._rows)

    def take_spans(self, length: int) -> list[tuple[int, int]]:
        """For a caller that feeds the rows itself (``rows[b].lay_out``/``attend``): the rows
        unpacked, each row's ``(first, count)`` real tokens of a call of ``length``, the
        padding consumed as :meth:`lay_out` would."""
        if self._spans is not None:
            raise RuntimeError("a call is waiting for attend()")
        self._unpack()
        return self._take_spans(length)

    def _take_spans(self, length: int) -> list[tuple[int, int]]:
        spans = []
        for b in range(len(self._rows)):
            skip = min(self._pad_left[b], length)
            self._pad_left[b] -= skip
            count = length - skip
            left = self._real_left[b]
            if left is not None:
                count = min(count, left)
                self._real_left[b] = left - count
            spans.append((skip, count))
        return spans

    # -- the model's calls -------------------------------------------------------------------
    def lay_out(self, keys: mx.array, values: mx.array) -> None:
        """Give each row its real tokens of ``[B, H_kv, L, D]`` keys/values; attention happens
        in :meth:`attend`, per row."""
        if self._spans is not None:
            raise RuntimeError(
                "a batched Velox cache needs the attention hook (KVCacheBuilder.for_model "
                "installs it): update_and_fetch() was called twice without attention"
            )
        if self._decode_call(keys) and self._try_pack():
            assert self._packed is not None
            keys, values = self._rows[0].stored(keys, values)
            check_fits(self._packed.state.slots, keys, values)
            self._packed_call = (keys, values)
            self._spans = [(0, 1)] * len(self._rows)
            return
        self._unpack()
        B = len(self._rows)
        fed = next((r.view().slots for r in self._rows if r.view().slots is not None), None)
        if fed is None:
            check_kv(keys, values, expect=None, dtype=None)
        else:
            _, H, _, D = fed.keys.shape
            value_dim = int(fed.values.shape[3])
            check_kv(keys, values, expect=(B, H, D), dtype=fed.keys.dtype, value_dim=value_dim)
        if keys.shape[0] != B:
            raise ValueError(f"keys B ({keys.shape[0]}) differs from the {B} rows")
        spans = self._take_spans(keys.shape[2])
        for b, (row, (first, count)) in enumerate(zip(self._rows, spans, strict=True)):
            if count:
                part = slice(first, first + count)
                row.lay_out(keys[b : b + 1, :, part], values[b : b + 1, :, part])
        self._spans = spans

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """``[B, H_q, L, D]``: each row's real queries over its own candidates and mask; zero
        at padded queries."""
        if self._spans is None:
            raise RuntimeError("attend() called before update_and_fetch()")
        spans, self._spans = self._spans, None
        if self._packed_call is not None:
            assert self._packed is not None
            (keys, values), self._packed_call = self._packed_call, None
            row = self._rows[0]
            with summing_over(row.group):
                step, self._packed = packed_update(
                    row.policy, self._packed, keys=keys, values=values, queries=queries, scale=scale
                )
            return attend_step(queries, step, scale, sinks)
        return attend_rows(queries, spans, lambda b, q: self._rows[b].attend(q, scale, sinks))

    def _decode_call(self, keys: mx.array) -> bool:
        """Whether a call is one real token for every row (no padding pending)."""
        return (
            keys.ndim == 4
            and keys.shape[2] == 1
            and keys.shape[0] == len(self._rows)
            and not self._padding_pending()
        )

    def _padding_pending(self) -> bool:
        return any(self._pad_left) or any(r is not None for r in self._real_left)

    # -- batch membership ----------------------------------------------------------------------
    def copy_rows(self) -> list[Layer]:
        """Independent copies of every row's layer (between calls only)."""
        self._unpack()
        if self._spans is not None or self._padding_pending():
            raise ValueError("cannot take rows out of a batched cache in the middle of a call")
        return [copy.copy(row) for row in self._rows]

    def filter(self, batch_indices: Any) -> None:
        """Keep rows ``batch_indices`` (list or ``mx.array`` of ints), in that order."""
        self._unpack()
        keep = indices(batch_indices, len(self._rows))
        if not keep:
            raise ValueError("filter() must keep at least one row (drop the cache instead)")
        # a row kept twice: the second is a copy
        self._rows = [
            copy.copy(self._rows[i]) if i in keep[:j] else self._rows[i] for j, i in enumerate(keep)
        ]
        self._pad_left = [self._pad_left[i] for i in keep]
        self._real_left = [self._real_left[i] for i in keep]

    def extend(
        self, new: list[Layer], padding: tuple[list[int], list[int | None]] | None = None
    ) -> None:
        """Append rows ``new`` (independent layers of the same policy and settings, with their
        pending ``padding``); ``ValueError`` naming what differs, and nothing changes,
        otherwise."""
        if self._spans is not None:
            raise ValueError("cannot extend a batched cache in the middle of a call")
        self._unpack()
        pads, real = padding or ([0] * len(new), [None] * len(new))
        check_rows(new, "other")
        signatures = [_signature(row) for row in (*self._rows, new[0])]
        check_compatible(signatures, "this batch and other")  # its rows are compatible already
        self._rows = [*self._rows, *new]
        self._pad_left += pads
        self._real_left += real

    def take(self, idx: int) -> Layer:
        """Row ``idx`` as an independent single-sequence layer whose arrays are its own: a row
        of packed rows would otherwise keep every row's buffers alive (``nbytes`` would then
        under-count what a prompt cache holds)."""
        i = check_index(idx, len(self._rows), "batch index")
        if self._spans is not None:
            raise ValueError("cannot extract a row in the middle of a call")
        self._unpack()
        row = copy.copy(self._rows[i])
        row.settle()
        row.restore(detach(row.state), row.log)
        return row

    # -- trims (speculative decoding is one sequence at a time in mlx-lm; kept for symmetry) ----
    def trim(self, n: int) -> int:
        """Trim ``n`` tokens from every row exactly; all or nothing."""
        trimmed = [copy.copy(row) for row in self.rows]
        for row in trimmed:
            row.trim(n)
        self._rows = trimmed
        return n

    def packed_arrays(self) -> dict[str, list[mx.array]] | None:
        """The packed rows' arrays (slots and log), or ``None`` while the rows are unpacked."""
        packed = self._packed
        if packed is None:
            return None
        logs = [] if packed.log is None else packed.log.arrays()
        return {"slots": packed.state.slots.arrays(), "log": logs}


def _row_stats(row: Layer) -> dict[str, int]:
    """One unpacked row's stats (as ``LayerBatch.row_stats`` gives them)."""
    state = row.view()
    undo = 0 if row.log is None else row.log.nbytes
    tier = 0 if row.tier is None else row.tier.nbytes  # the demoted tier (velox_cache_core.demoted)
    stats = {
        "tokens_seen": row.offset,
        "tokens_kept": int(state.tokens_kept),
        "pinned_tokens": seen_pinned(state.pins, row.offset),
        "kv_bytes": int(state.nbytes) + tier,
        "cache_bytes": int(state.held_nbytes) + undo + tier,
    }
    if row.tier is not None:
        stats["demoted_tokens"] = row.tier.n_rows
    return stats
