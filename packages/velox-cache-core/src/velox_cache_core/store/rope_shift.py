"""Compact RoPE positions: keep every query-to-key distance inside the model's trained context.

RoPE attention depends on the distance between a query's and a key's rotation. A bounded cache
keeps a few old rows (sinks, rows a policy found important) while the token index keeps
growing, so past the model's context ``C`` the distance from the current query to those rows
exceeds anything the model was trained on. With compact positions (llama.cpp's context shift,
generalised to the sparse rows an eviction policy keeps), when the next call would reach ``C``
every kept row is moved down to close the gaps its evicted neighbours left:

- sinks (token index ``< n_sink``) keep their rotation;
- the other kept rows of each (batch row, KV head), in token order, are laid just below
  ``top`` (the budget): the newest at ``top - 1``, the one before at ``top - 2``, ... Each
  key is rotated once more, by ``-(old - new)`` (:func:`rotate`);
- the next token is rotated at ``top`` instead of its token index less the previous lag: the
  layer's ``lag`` (token index minus RoPE position of the next token) grows by ``Δ``, the same
  for every layer of a model (each layer shifts at the same call, to the same ``top``).

Token indices (``KVSlots.positions``: sinks, windows, ties, pins) never change; only the
rotation the keys carry and the offset the model rotates its next tokens at do. The RoPE
position of a stored row is recovered from its token index (:meth:`Compaction.rope_positions`):
a row kept at the last shift has the position the shift gave it (the ``anchor_*`` arrays), a
row that arrived since sits at its token index less ``lag``.

Keys quantized per token (:class:`~velox_cache_core.store.token_rows.QRows`) are shifted through
dequantize, rotate, quantize (one more rounding per shift a row lives through; shifts come once
per ``context - top`` tokens). Main keys quantized per channel are not shifted (refused).

A demoted tier (:mod:`velox_cache_core.store.tier`) shifts with the main rows: its rows and
the main rows' movable ones are ranked together in token order and laid below ``top``, which
then counts the tier's budget too (``budget + demote_budget``); the tier's keys (per channel,
at its width) go through dequantize, rotate, quantize as a whole. The anchors hold the tier's
rows as well, so a row demoted after a shift keeps the position the shift gave it.

Nothing here imports the rest of the core but the store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, ClassVar

import mlx.core as mx

from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.store.tier import Tier
from velox_cache_core.store.token_rows import QRows
from velox_cache_core.validation import check_bool


@dataclass(frozen=True)
class Rope:
    """A model's rotation as ``mx.fast.rope`` takes it (mlx's ``nn.RoPE`` fields): the first
    ``dims`` features rotated, frequencies ``base ** (-2i / dims)``, positions multiplied by
    ``scale`` (linear scaling), pairs interleaved when ``traditional``."""

    dims: int
    base: float
    traditional: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.dims, bool) or not isinstance(self.dims, int):
            raise TypeError(f"dims must be an int, got {type(self.dims).__name__}")
        if self.dims < 2 or self.dims % 2:
            raise ValueError(f"dims must be an even int >= 2, got {self.dims}")
        for name in ("base", "scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        check_bool("traditional", self.traditional)


def rotate(x: mx.array, shift: int | mx.array, rope: Rope) -> mx.array:
    """``x`` ``[B, H, n, D]`` rotated at positions ``p`` returned as rotated at ``p - shift``.

    ``shift``: a Python int (every row the same) or int ``[B, H, n]`` (one per row). A RoPE
    rotation by ``a`` then by ``b`` is the rotation by ``a + b``, so this is ``mx.fast.rope``
    at offset ``-shift`` applied to each row on its own; the features past ``rope.dims`` are
    unchanged. Computed in float32 and returned in ``x``'s dtype."""
    if x.ndim != 4:
        raise ValueError(f"x must be [B, H, n, D], got shape {tuple(x.shape)}")
    B, H, n, D = x.shape
    if rope.dims > D:
        raise ValueError(f"rope.dims must be <= the head dim {D}, got {rope.dims}")
    offset: int | mx.array
    if isinstance(shift, int) and not isinstance(shift, bool):
        offset = -shift
    elif isinstance(shift, mx.array):
        if tuple(shift.shape) != (B, H, n):
            raise ValueError(f"shift must be an int or [B, H, n] = {(B, H, n)}, got {shift.shape}")
        if not mx.issubdtype(shift.dtype, mx.integer):
            raise TypeError(f"shift must hold integers, got {shift.dtype}")
        offset = -shift.reshape(-1).astype(mx.int32)
    else:
        raise TypeError(f"shift must be an int or an mx.array, got {type(shift).__name__}")
    if n == 0 or (isinstance(offset, int) and offset == 0):
        return x
    out = mx.fast.rope(
        x.reshape(B * H * n, 1, D).astype(mx.float32),
        rope.dims,
        traditional=rope.traditional,
        base=float(rope.base),
        scale=float(rope.scale),
        offset=offset,
    )
    return out.reshape(B, H, n, D).astype(x.dtype)


def rotate_rows(keys: Any, shift: int | mx.array, rope: Rope) -> Any:
    """:func:`rotate` for stored keys: full precision, or quantized per token (dequantized,
    rotated and quantized again in the same format)."""
    if isinstance(keys, mx.array):
        return rotate(keys, shift, rope)
    if isinstance(keys, QRows):
        return keys.quant.quantize(rotate(keys.dense(), shift, rope))
    raise TypeError(
        "positions='compact' shifts full-precision keys or keys quantized per token, got "
        f"{type(keys).__name__} (keys quantized per channel)"
    )


def rotate_tier(tier: Tier, shift: mx.array, rope: Rope) -> Tier:
    """``tier`` with its keys rotated by ``-shift`` (int ``[B, H, T]``, one per row): dequantized,
    rotated and quantized again per channel at the tier's width."""
    keys = rotate(tier.keys.dense(), shift, rope)
    rotated = KRows.from_dense(keys, tier.keys.bits, tier.keys.group_size, window=True)
    return replace(tier, keys=rotated.settled())


def compacted(
    positions: mx.array, live: mx.array, n_sink: int, top: int, fixed: mx.array | None = None
) -> mx.array:
    """int32 ``[B, H, S]``: the RoPE positions a shift gives the rows at token ``positions``.

    Sinks (``< n_sink``) keep theirs; the other ``live`` rows of each ``[b, h]``, in token
    order, are laid just below ``top`` (the newest at ``top - 1``). Dead slots keep their
    token index (nothing reads them). ``fixed`` (bool ``[B, H, S]``): more rows that do not
    move (pinned spans); the caller keeps their RoPE positions (:meth:`Compaction.shift`)."""
    movable = live & (positions >= n_sink)
    if fixed is not None:
        movable = movable & ~fixed
    key = mx.where(movable, positions, -1)
    rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1).astype(mx.int32)  # ascending
    S = positions.shape[-1]
    return mx.where(movable, top - S + rank, positions).astype(mx.int32)


@dataclass(frozen=True)
class Compaction:
    """One layer's compact positions: the model's ``context`` and ``rope``, the kept rows'
    ``top`` (the budget) and ``n_sink``, and what the shifts so far did.

    ``lag``: the token index of the next token minus the RoPE position the model rotates it
    at (0 until the first shift). ``shifted_at``: token index of the first token after the last
    shift (0: none yet). ``anchor_positions``/``anchor_ropes``: int32 ``[B, H, S]``, the token
    indices of the rows kept at the last shift (-1 for a dead slot) and the RoPE positions it
    gave them. Immutable: a shift returns a new object, so copies of a cache share it."""

    context: int
    rope: Rope
    top: int
    n_sink: int
    lag: int = 0
    shifted_at: int = 0
    shifts: int = 0
    anchor_positions: mx.array | None = None
    anchor_ropes: mx.array | None = None

    # the array fields (saved beside the JSON of :meth:`scalars`)
    ARRAYS: ClassVar[tuple[str, ...]] = ("anchor_positions", "anchor_ropes")

    def __post_init__(self) -> None:
        for name, low in (("context", 2), ("top", 1), ("n_sink", 0), ("lag", 0), ("shifts", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.top >= self.context:
            raise ValueError(
                f"positions='compact' lays the kept rows below the budget (with a demoted "
                f"tier: plus demote_budget) ({self.top}), which must be below the model's "
                f"context ({self.context})"
            )

    def offset(self, token_offset: int) -> int:
        """The RoPE position the model rotates the token at ``token_offset`` at."""
        return token_offset - self.lag

    def needs_shift(self, token_offset: int, length: int) -> bool:
        """Whether a call of ``length`` tokens starting at ``token_offset`` would reach the
        context (a RoPE position ``>= context``)."""
        return self.offset(token_offset) + length > self.context

    def check_fits(self, length: int) -> None:
        """``ValueError`` when ``length`` tokens after a shift would not fit in the context
        above the kept rows (``top + length > context``)."""
        if self.top + length > self.context:
            raise ValueError(
                f"positions='compact': a call of {length} tokens does not fit in the model's "
                f"context ({self.context}) above the {self.top} kept rows; feed chunks of at "
                f"most {self.context - self.top} tokens (or use positions='absolute')"
            )

    def rope_positions(self, positions: mx.array) -> mx.array:
        """int32 ``[B, H, S]``: the RoPE position each row at token ``positions`` was rotated at."""
        since = (positions - self.lag).astype(mx.int32)
        if self.anchor_positions is None or self.anchor_ropes is None:
            return since
        anchors = self.anchor_positions
        if anchors.shape[:2] != positions.shape[:2]:
            raise ValueError(
                f"the compact positions were kept for {tuple(anchors.shape[:2])} (batch, heads), "
                f"the rows are {tuple(positions.shape[:2])}"
            )
        match = positions[..., :, None] == anchors[..., None, :]  # [B, H, S, S_anchor]
        found = mx.any(match, axis=-1)
        kept = mx.sum(mx.where(match, self.anchor_ropes[..., None, :], 0), axis=-1)
        return mx.where(found & (positions < self.shifted_at), kept, since).astype(mx.int32)

    def shift(
        self,
        slots: KVSlots | None,
        token_offset: int,
        length: int,
        fixed: Any = None,
        tier: Tier | None = None,
    ) -> tuple[KVSlots | None, Tier | None, Compaction, int]:
        """Shift before a call of ``length`` tokens at ``token_offset``: ``(slots with their
        keys rotated to the compacted positions, ``tier`` likewise, the compaction after, Δ)``;
        the call's keys and queries, rotated at ``offset(token_offset) + i`` by the model, must
        be rotated by ``-Δ`` (:func:`rotate`). ``fixed(positions)``: bool ``[B, H, S]``, the
        rows that keep their RoPE positions besides the sinks (pinned spans), or ``None``.
        ``tier``: the layer's demoted rows, ranked with the main rows (``top`` must count its
        budget). ``ValueError`` when the call cannot fit the context even after compaction
        (``top + length > context``)."""
        self.check_fits(length)
        delta = self.offset(token_offset) - self.top
        if delta <= 0:  # nothing to close (cannot happen when needs_shift held)
            return slots, tier, self, 0
        after = replace(self, lag=self.lag + delta, shifted_at=token_offset, shifts=self.shifts + 1)
        if slots is None or slots.positions.shape[-1] == 0:
            return slots, tier, after, delta
        positions = slots.positions
        S = int(positions.shape[-1])
        live = (  # bool [B, H, S]: every slot but each row's dead one
            mx.ones(positions.shape, dtype=mx.bool_)
            if slots.free is None
            else mx.arange(S)[None, None, :] != slots.free[:, :, None]
        )
        kept = None if fixed is None else fixed(positions)
        anchors = mx.where(live, positions, -1).astype(mx.int32)
        moving = tier if tier is not None and tier.n_rows else None
        if moving is not None:  # ranked together, in token order
            none = mx.zeros(moving.positions.shape, dtype=mx.bool_)
            positions = mx.concatenate([positions, moving.positions], axis=-1)
            live = mx.concatenate([live, ~none], axis=-1)
            kept = None if kept is None else mx.concatenate([kept, none], axis=-1)
            anchors = mx.concatenate([anchors, moving.positions], axis=-1)
        old = self.rope_positions(positions)
        new = compacted(positions, live, self.n_sink, self.top, kept)
        if kept is not None:
            new = mx.where(kept, old, new).astype(mx.int32)
        moves = mx.where(live, old - new, 0).astype(mx.int32)
        shifted = replace(
            slots, keys=rotate_rows(slots.keys, moves[..., :S], self.rope), reserve=None
        )
        if moving is not None:
            tier = rotate_tier(moving, moves[..., S:], self.rope)
        return shifted, tier, replace(after, anchor_positions=anchors, anchor_ropes=new), delta

    # -- saving ------------------------------------------------------------------------------
    def scalars(self) -> dict[str, Any]:
        """The JSON-ready fields (the anchors are arrays: :meth:`arrays`)."""
        return {
            f.name: asdict(self.rope) if f.name == "rope" else getattr(self, f.name)
            for f in fields(self)
            if f.name not in self.ARRAYS
        }

    def arrays(self) -> dict[str, mx.array | None]:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @classmethod
    def load(cls, scalars: dict[str, Any], arrays: dict[str, Any]) -> Compaction:
        """The compaction :meth:`scalars` and :meth:`arrays` describe."""
        fields = dict(scalars)
        rope = Rope(**fields.pop("rope"))
        return cls(rope=rope, **fields, **arrays)
