"""The demoted tier: rows a policy evicted from the main rows, kept at fewer bits.

Keys per channel over groups of ``group_size`` tokens (:class:`KRows`, KIVI's keys), values
per token (:class:`QRows`), both at ``bits``. Each row carries its position and a score;
when the tier holds more than ``budget`` rows per (batch row, KV head), the lowest-scored go.
Rows never come back to the main rows: their full-precision data is gone.

A tier's arrays: keys/values ``[B, H_kv, T, D]``, positions int32 ``[B, H_kv, T]``, scores
float32 ``[B, H_kv, T]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from velox_cache_core.store import rows
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.token_rows import GROUP_SIZES, QRows, Quant, check_member
from velox_cache_core.validation import check_int

TIER_BITS = (2, 4)
"""The widths a tier takes (``demote_bits``)."""

SCORING = ("weights", "accumulated", "recency")
"""How a tier ranks its rows: the last weight the call's query gave each row (TOVA, MorphKV,
SnapKV, Expected Attention), the weights summed over every call (H2O), or the position
(StreamingLLM: the newest stay)."""


@dataclass(frozen=True)
class TierSpec:
    """A demoted tier's settings: ``bits`` (``demote_bits``), ``budget`` rows per (batch
    row, KV head) (``demote_budget``), the quantization group and how rows are ranked
    (:data:`SCORING`; a :class:`~velox_cache_core.layer.Layer` sets it from its policy's
    ``demote_scoring``)."""

    bits: int
    budget: int
    group_size: int = 64
    scoring: str = "weights"

    def __post_init__(self) -> None:
        check_member("demote_bits", self.bits, TIER_BITS)
        check_int("demote_budget", self.budget, minimum=1)
        if self.group_size not in GROUP_SIZES:
            choices = ", ".join(map(str, GROUP_SIZES))
            raise ValueError(f"kv_group_size must be one of {choices}, got {self.group_size}")
        if self.scoring not in SCORING:
            raise ValueError(f"scoring must be one of {SCORING}, got {self.scoring!r}")

    def check_width(self, width: int, what: str = "the values' width") -> None:
        """``ValueError`` unless value rows ``width`` features wide split into quantization
        groups (keys are grouped along their tokens: any width fits)."""
        Quant(self.bits, self.group_size).check_width(width, what, off="demote_bits")

    def max_nbytes(self, kv_heads: int, head_dim: int, itemsize: int) -> int:
        """The most one batch row's tier holds between calls, in bytes: per KV head,
        ``budget`` rows of values (``bits`` per feature, a scale and bias per group) and their
        position and score; the keys' physical rows (fewer than ``group_size`` dead ones
        besides the live, a scale and bias per feature and group) and their window of fewer
        than ``group_size`` full-precision rows, and the row map."""
        G, S = self.group_size, self.budget
        physical = S + G - 1
        values = S * (head_dim * self.bits // 8 + 2 * (head_dim // G) * itemsize)
        keys = physical * head_dim * self.bits // 8 + 2 * head_dim * -(-physical // G) * itemsize
        keys += (G - 1) * head_dim * itemsize + 4 * S
        return kv_heads * (values + keys + 8 * S)


@dataclass(frozen=True, eq=False)
class Tier:
    """The demoted rows of one layer (module docstring for the shapes)."""

    keys: KRows
    values: QRows
    positions: mx.array
    scores: mx.array

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[2])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [*self.keys.arrays(), *self.values.arrays(), self.positions, self.scores]

    def rescored(self, scores: mx.array) -> Tier:
        return Tier(self.keys, self.values, self.positions, scores)


def demote(
    spec: TierSpec,
    tier: Tier | None,
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    scores: mx.array,
) -> Tier | None:
    """``tier`` with rows ``keys``/``values`` ``[B, H_kv, V, D]`` (full precision; their
    ``positions`` and ``scores`` ``[B, H_kv, V]``) quantized into it, then cut back to
    ``spec.budget`` rows by score."""
    if int(keys.shape[2]) == 0:
        return tier
    new_keys = KRows.from_dense(keys, spec.bits, spec.group_size, window=True)
    new_values = Quant(spec.bits, spec.group_size).quantize(values)
    positions = positions.astype(mx.int32)
    scores = scores.astype(mx.float32)
    if tier is None:
        out = Tier(new_keys.settled(), new_values, positions, scores)
    else:
        out = Tier(
            rows.concat([tier.keys, new_keys], axis=2).settled(),  # type: ignore[union-attr]
            rows.concat([tier.values, new_values], axis=2),  # type: ignore[arg-type]
            mx.concatenate([tier.positions, positions], axis=2),
            mx.concatenate([tier.scores, scores], axis=2),
        )
    if out.n_rows <= spec.budget:
        return out
    return keep_best(out, spec.budget)


def keep_best(tier: Tier, budget: int) -> Tier:
    """The ``budget`` highest-scored rows of each (batch row, head), in their order; among
    equal scores the newer rows stay (rows ranked newest first, then by score with MLX's
    sort, which keeps the order of equal keys)."""
    newest_first = mx.argsort(-tier.positions, axis=-1)
    ranked = mx.argsort(-mx.take_along_axis(tier.scores, newest_first, axis=-1), axis=-1)
    best = mx.take_along_axis(newest_first, ranked[..., :budget], axis=-1)
    keep = mx.sort(best, axis=-1)
    return Tier(
        rows.take(tier.keys, keep),  # type: ignore[arg-type]
        rows.take(tier.values, keep),  # type: ignore[arg-type]
        mx.take_along_axis(tier.positions, keep, axis=-1),
        mx.take_along_axis(tier.scores, keep, axis=-1),
    )


def demote_one(spec: TierSpec, tier: Tier, keys: mx.array, values: mx.array,
               positions: mx.array, scores: mx.array) -> Tier:  # fmt: skip
    """One row per (batch row, head) (``[B, H_kv, 1, D]``, positions and scores ``[B, H_kv,
    1]``) into a full tier, written in place: it takes the place of the tier's lowest-scored
    row when it scores higher (or as high, and is newer), else it goes. The same rows
    :func:`demote` keeps, without rebuilding the tier (a decode step's eviction)."""
    # the row keep_best would drop: the lowest score, the oldest among equal ones
    low = mx.min(tier.scores, axis=-1, keepdims=True)
    oldest = mx.where(tier.scores == low, tier.positions, mx.iinfo(mx.int32).max)
    slot = mx.argmin(oldest, axis=-1, keepdims=True).astype(mx.int32)  # [B, H, 1]
    there = mx.take_along_axis(tier.positions, slot, axis=-1)
    positions = positions.astype(mx.int32)
    taken = (scores > low) | ((scores == low) & (positions > there))

    def put(old: mx.array, new: mx.array) -> mx.array:
        """``new`` at ``slot`` where it is taken (``old``'s row stays elsewhere)."""
        at = slot.reshape(*slot.shape, *([1] * (old.ndim - 3)))
        at = mx.broadcast_to(at, (*old.shape[:2], 1, *old.shape[3:]))
        here = mx.take_along_axis(old, at, axis=2)
        pick = taken.reshape(*taken.shape, *([1] * (old.ndim - 3)))
        return mx.put_along_axis(old, at, mx.where(pick, new, here), axis=2)

    new_keys = KRows.from_dense(keys, spec.bits, spec.group_size, window=True)
    new_values = Quant(spec.bits, spec.group_size).quantize(values)
    return Tier(
        rows.write(tier.keys, new_keys, put),  # type: ignore[arg-type]
        rows.write(tier.values, new_values, put),  # type: ignore[arg-type]
        put(tier.positions[..., None], positions.astype(mx.int32)[..., None])[..., 0],
        put(tier.scores[..., None], scores.astype(mx.float32)[..., None])[..., 0],
    )
