"""Batched Velox caches: what ``mlx_lm.generate.BatchGenerator`` (``batch_generate``,
``mlx_lm.server``) uses when every layer cache has ``merge``.

A :class:`BatchVeloxKVCache` is mlx-lm's batched cache protocol over one core
:class:`velox_cache_core.layer_batch.LayerBatch`: one single-sequence layer per row, each
keeping its own offset, positions, evictions and running state, so row ``b`` of a batch keeps
exactly what the same sequence keeps alone (row equivalence). Padding is never stored (mlx-lm
right-pads prompts and passes ``lengths``; left padding works too), and ``attend`` (reached
through the attention hook) attends each row over its own keys with its own mask, ignoring the
mask the model shares between layers (built from one layer's cache, it would be wrong for the
others, which evict different tokens).

With compact positions (``KVCacheConfig(positions="compact")``) every row keeps its own
:class:`~velox_cache_core.store.rope_shift.Compaction` and shifts at its own calls
(``velox_mlx_lm.positions``): ``offset`` is each row's compacted position, and a call's keys
and queries are rotated per row by the shift their row took before it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from velox_cache_core import Compaction, Layer, LayerBatch, indices
from velox_cache_core import batch as core_batch
from velox_mlx_lm.base import VeloxKVCache, fetched_as_is
from velox_mlx_lm.positions import feed_row, same_compaction, shift_layer
from velox_mlx_lm.prompt_state import encode

Compactions = list[Compaction | None]


def _layers(cache: Any, where: str) -> tuple[list[Layer], Any, Any, Compactions]:
    """Independent copies of a Velox cache's layers (a batched one gives all its rows), its
    pending padding, the single-sequence cache class rows are extracted as, and each row's
    compact positions (``None``: absolute)."""
    if isinstance(cache, BatchVeloxKVCache):
        rows = cache.batch.copy_rows()
        return rows, cache.batch.padding, cache.row_type, cache.compactions
    layer = cache.layer if isinstance(cache, VeloxKVCache) else None
    if layer is None:
        raise TypeError(
            f"{where} must be a Velox cache, got {type(cache).__name__}: every layer of "
            "a batch must use the same kind of cache"
        )
    return [copy.copy(layer)], None, type(cache), [getattr(cache, "compaction", None)]


def _check_positions(compactions: Compactions, where: str) -> None:
    """``ValueError`` unless every row has the same positions (absolute, or compact with the
    same context, rotation, budget and sinks)."""
    first = compactions[0]
    for comp in compactions[1:]:
        if not same_compaction(first, comp):
            mode = {True: "compact", False: "absolute"}
            raise ValueError(
                f"{where} mixes positions: rows with {mode[first is not None]} positions and "
                f"rows with {mode[comp is not None]} ones (or compact positions of another "
                "context, rotation or budget) cannot share a batch"
            )


def merge(caches: Sequence[Any]) -> BatchVeloxKVCache:
    """One batched cache from single-sequence (or batched) Velox caches of one layer, in order.

    Caches that already evicted merge as they are: each keeps its own rows and offset. Raises
    ``ValueError`` naming what differs (policy, a setting, trim window, heads, dtype) and
    leaves the caches unchanged.
    """
    if not isinstance(caches, Sequence) or isinstance(caches, (str, bytes)):
        raise TypeError(f"caches must be a list of caches, got {type(caches).__name__}")
    rows: list[Layer] = []
    compactions: Compactions = []
    row_type = None
    for i, cache in enumerate(caches):
        layers, _, kind, comps = _layers(cache, f"caches[{i}]")
        rows += layers
        compactions += comps
        row_type = row_type or kind
    if not rows:
        raise ValueError("caches must hold at least one cache")
    _check_positions(compactions, "caches")
    return BatchVeloxKVCache(LayerBatch(rows), row_type, compactions)


class BatchVeloxKVCache(VeloxKVCache):
    """``B`` sequences of one Velox policy in one layer (``batch``: the core's rows);
    ``row_type``: the single-sequence cache class rows are extracted as. Needs the attention
    hook (``KVCacheBuilder.for_model``)."""

    _fetched: tuple[mx.array, mx.array] | None = None  # what update_and_fetch returned last
    # compact positions: each row's compaction (None: every row absolute), and the shift each
    # row's queries of the call in flight still need
    _compactions: Compactions | None = None
    # a call some row shifts in: (each row's real span, keys, values); attend feeds the rows
    _rows_call: tuple[list[tuple[int, int]], mx.array, mx.array] | None = None

    def __init__(
        self, batch: LayerBatch, row_type: Any, compactions: Compactions | None = None
    ) -> None:
        self.batch = batch
        self.row_type = row_type
        if compactions is not None:
            if len(compactions) != len(batch):
                raise ValueError(
                    f"compactions must give one per row ({len(batch)}), got {len(compactions)}"
                )
            if any(c is not None for c in compactions):
                _check_positions(compactions, "compactions")
                self._compactions = list(compactions)

    @property
    def compactions(self) -> Compactions:
        """Each row's compact positions (``None``: absolute)."""
        comps = self._compactions
        return [None] * len(self.batch) if comps is None else list(comps)

    # -- what BatchGenerator reads ---------------------------------------------------------
    @property
    def rows(self) -> list[Layer]:
        """The rows' single-sequence layers (unpacked first when packed)."""
        return self.batch.rows

    @property
    def policy_name(self) -> str:
        return self.batch.rows_policy.name

    @property
    def offset(self) -> mx.array:
        """int32 ``[B]``: each row's position of its next real token (with compact positions
        the compacted one: the token index less the row's lag)."""
        offsets = self.batch.offsets
        comps = self._compactions
        if comps is not None:
            offsets = [o - (0 if c is None else c.lag) for o, c in zip(offsets, comps, strict=True)]
        return mx.array(offsets, dtype=mx.int32)

    @property
    def tokens_kept(self) -> list[int]:
        """Retained tokens per row (per KV head)."""
        return self.batch.tokens_kept

    @property
    def tokens_seen(self) -> list[int]:
        return self.batch.tokens_seen

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values the rows hold (rows packed below their budget also
        hold the padding slots that align them)."""
        return self.batch.nbytes

    @property
    def undo_nbytes(self) -> int:
        return self.batch.undo_nbytes

    def row_stats(self) -> list[dict[str, int]]:
        """Per row: ``tokens_seen``, ``tokens_kept``, ``kv_bytes`` and ``cache_bytes``."""
        return self.batch.row_stats()

    def size(self) -> int:
        """The longest row's retained tokens."""
        return self.batch.size()

    def empty(self) -> bool:
        return self.batch.empty()

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def keys(self) -> mx.array | None:
        """Row 0's retained keys, or the packed rows' keys (what pipeline-parallel models tie
        their send to, every forward pass: reading them does not unpack)."""
        return self.batch.keys

    @keys.setter
    def keys(self, value: Any) -> None:
        """Tie ``value`` to the stored keys (see ``PolicyKVCache.keys``) without changing them."""
        if isinstance(value, mx.array):
            self.batch.tie(value)

    def prepare(
        self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None
    ) -> None:
        """Say which tokens of the coming calls are padding (see ``LayerBatch.prepare``)."""
        self.batch.prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)

    def finalize(self) -> None:
        """End of a padded prompt: later calls are all real tokens again."""
        self.batch.finalize()

    # -- the model's calls -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Give each row its real tokens of ``[B, H_kv, L, D]`` keys/values. The return value
        is the input: attention happens in :meth:`attend`, per row. With compact positions, a
        row whose call would reach the model's context shifts first (its keys rotated here,
        its queries in :meth:`attend`)."""
        if self._compactions is not None and self._shifts_in(keys):
            self._rows_call = (self.batch.take_spans(int(keys.shape[2])), keys, values)
            self._fetched = (keys, values)
            return keys, values
        self.batch.lay_out(keys, values)
        self._fetched = (keys, values)
        return keys, values

    def attend(
        self,
        queries: mx.array,
        scale: float,
        mask: Any,
        sinks: mx.array | None,
        keys: mx.array | None = None,
        values: mx.array | None = None,
    ) -> mx.array:
        """``[B, H_q, L, D]``: each row's real queries over its own candidates and mask (the
        model's shared ``mask`` is not used); zero at padded queries. A model attending over
        keys, values or scores of its own is refused."""
        if not fetched_as_is(self._fetched, keys, values, mask):
            raise ValueError(
                "this model attends over keys, values or scores of its own (not what "
                "update_and_fetch returned): a batched Velox cache cannot serve it; "
                "generate one sequence at a time"
            )
        comps = self._compactions
        if comps is None:
            return self.batch.attend(queries, scale, sinks)
        if self._rows_call is not None:
            out = self._attend_rows(queries, scale, sinks)
        else:
            out = self.batch.attend(queries, scale, sinks)
        self._shift_after()
        return out

    # -- compact positions -----------------------------------------------------------------------
    def _shifts_in(self, keys: mx.array) -> bool:
        """Whether some row's call of ``keys`` would reach the model's context (counting every
        column as real: a padded row is then fed alone too, which changes nothing)."""
        comps = self._compactions
        assert comps is not None
        if self._rows_call is not None:
            raise RuntimeError(
                "positions='compact': the last call's queries never came back through the "
                "attention hook (a batched cache needs it)"
            )
        length = int(keys.shape[2])
        offsets = self.batch.offsets
        return any(
            c is not None and c.needs_shift(o, length) for o, c in zip(offsets, comps, strict=True)
        )

    def _attend_rows(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        """A call some row shifts in, fed row by row: each row's real tokens as the same
        sequence alone takes them (:func:`velox_mlx_lm.positions.feed_row`)."""
        assert self._rows_call is not None and self._compactions is not None
        (spans, keys, values), self._rows_call = self._rows_call, None
        comps = self._compactions
        parts: list[mx.array | None] = []
        for b, (row, (first, count)) in enumerate(zip(self.batch.rows, spans, strict=True)):
            if count == 0:
                parts.append(None)
                continue
            part = slice(first, first + count)
            out, comps[b] = feed_row(
                row,
                comps[b],
                keys[b : b + 1, :, part],
                values[b : b + 1, :, part],
                queries[b : b + 1, :, part],
                scale,
                sinks,
            )
            parts.append(out)
        return core_batch.scatter(parts, spans, queries)

    def _shift_after(self) -> None:
        """Shift, after a call's attention, the rows whose next token would reach the context
        (so that ``offset`` stays below it between calls)."""
        comps = self._compactions
        assert comps is not None
        seen = self.batch.tokens_seen
        need = [c is not None and c.needs_shift(o, 1) for o, c in zip(seen, comps, strict=True)]
        if not any(need):
            return
        rows = self.batch.rows
        for b, row in enumerate(rows):
            comp = comps[b]
            if need[b] and comp is not None and row.pending is None:
                comps[b], _ = shift_layer(row, comp, 1)

    # -- batch membership ----------------------------------------------------------------------
    @classmethod
    def merge(cls, caches: list[Any]) -> BatchVeloxKVCache:
        return merge(caches)

    def filter(self, batch_indices: Any) -> None:
        """Keep rows ``batch_indices`` (list or ``mx.array`` of ints), in that order."""
        if isinstance(batch_indices, mx.array):
            batch_indices = batch_indices.tolist()
        comps = self._compactions
        keep = indices(batch_indices, len(self.batch)) if comps is not None else None
        self.batch.filter(batch_indices)
        if comps is not None and keep is not None:
            self._compactions = [comps[i] for i in keep]

    def extend(self, other: Any) -> None:
        """Append ``other``'s rows (a batched or single-sequence Velox cache of the same policy
        and settings); ``ValueError`` naming what differs, and nothing changes, otherwise."""
        if self.batch.pending:
            raise ValueError("cannot extend a batched cache in the middle of a call")
        new, padding, _, comps = _layers(other, "other")
        _check_positions([*self.compactions[:1], *comps], "this batch and other")
        self.batch.extend(new, padding)
        if self._compactions is not None:
            self._compactions += comps

    def extract(self, idx: int) -> Any:
        """Row ``idx`` as an independent single-sequence Velox cache (merge it again, save it
        with ``save_prompt_cache``, reuse it), owning its arrays."""
        (i,) = indices([idx], len(self.batch))
        cache = self.row_type.from_layer(self.batch.take(i))
        if self._compactions is not None:
            cache._compaction = self._compactions[i]
        return cache

    def is_trimmable(self) -> bool:
        return all(row.log is not None for row in self.rows)

    def trim(self, n: int) -> int:
        """Trim ``n`` tokens from every row exactly; all or nothing (a row with compact
        positions cannot trim back past its last shift: ``ValueError``)."""
        comps = self._compactions
        if comps is not None and isinstance(n, int):
            for b, (seen, comp) in enumerate(zip(self.batch.tokens_seen, comps, strict=True)):
                if comp is not None and comp.shifts and n > seen - comp.shifted_at:
                    raise ValueError(
                        f"cannot trim {n} tokens: positions='compact' shifted row {b}'s kept "
                        f"rows {seen - comp.shifted_at} tokens ago, and a trim cannot reach "
                        "back past a shift"
                    )
        self.batch.trim(n)
        return n

    # -- what mx.eval and copy.deepcopy see ------------------------------------------------------
    @property
    def state(self) -> list[Any]:
        """Every row's arrays (``mx.eval``-ed by mlx-lm after every prefill chunk); packed
        rows give the packed arrays."""
        packed = self.batch.packed_arrays()
        if packed is not None:
            return [packed]
        return [encode(row.view(), row.log) for row in self.batch.layers]

    @state.setter
    def state(self, v: Any) -> None:
        raise ValueError(
            "a batched Velox cache is not saved or loaded as a whole: extract() its rows and "
            "save those (each is a single-sequence cache)"
        )
