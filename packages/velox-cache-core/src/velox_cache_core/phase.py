"""A policy's model-driven phase in progress (KVzip's scoring pass): :class:`Phase`.

While the phase runs, every forward pass chunk's keys and values are attended to (over the
whole stored context, causally among themselves) but never stored, and the policy's
:class:`~velox_cache_core.declarations.Compressor` scores the context rows the chunk covers
from its queries; :meth:`velox_cache_core.layer.Layer.finish_phase` cuts the context by the
scores. The layer drives it through ``start_phase``, ``score_chunk``, ``finish_phase`` and
``abort_phase``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from velox_cache_core.declarations import Compressor
from velox_cache_core.engine import check_fits
from velox_cache_core.masks import chunk_causal
from velox_cache_core.store import rows as R
from velox_cache_core.store.slots import KVSlots


def compressor_of(policy: Any) -> Compressor:
    """The policy's model-driven phase (``ValueError`` when it declares none)."""
    compressor = policy.compressor
    if compressor is None:
        raise ValueError(f"policy {policy.name!r} declares no model-driven phase")
    return compressor


@dataclass
class Phase:
    """The phase of one layer: ``scores`` float32 ``[B, H_kv, n_i]`` of the chunks so far,
    ``chunk`` the context rows ``[start, end)`` the next pass scores, ``recon`` the keys and
    values ``[B, H_kv, L, D]`` of the call in flight (attended to, never stored)."""

    scores: list[mx.array] = field(default_factory=list)
    chunk: tuple[int, int] | None = None
    recon: tuple[mx.array, mx.array] | None = None

    def all_scores(self) -> mx.array:
        """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
        if not self.scores:
            raise ValueError("no chunk of the scoring pass was scored")
        return mx.concatenate(self.scores, axis=-1)

    def lay_out(
        self, state: Any, name: str, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The context (dequantized) then the call's rows at full precision: what the call
        attends over; the call is kept for :meth:`attend`."""
        live = _live(state, name)
        check_fits(live, keys, values, stored=False)  # attended over, never stored
        self.recon = (keys, values)
        return (
            mx.concatenate([R.dense(live.keys), keys.astype(live.keys.dtype)], axis=2),
            mx.concatenate([R.dense(live.values), values.astype(live.values.dtype)], axis=2),
        )

    def attend(
        self, state: Any, policy: Any, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        """``[B, H_q, L, D]``: score the chunk's context rows from ``queries``, then attend
        over the context and the call's rows (causal among them)."""
        if self.recon is None or self.chunk is None:
            raise RuntimeError("attend() in the scoring phase needs score_chunk() and a call")
        (keys, values), self.recon = self.recon, None
        start, end = self.chunk
        compressor = compressor_of(policy)
        self.scores.append(compressor.score(state, queries, keys, start, end, scale))
        live = _live(state, policy.name)
        dtype = live.keys.dtype
        all_keys = mx.concatenate([R.dense(live.keys), keys.astype(dtype)], axis=2)
        all_values = mx.concatenate([R.dense(live.values), values.astype(dtype)], axis=2)
        L = int(keys.shape[2])
        causal = None if L == 1 else chunk_causal(live.n_slots, L)[None, None]
        return mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=scale, mask=causal, sinks=sinks
        ).astype(queries.dtype)


def _live(state: Any, name: str) -> KVSlots:
    if state.slots is None:
        raise ValueError(f"the {name} cache holds no context to score")
    return state.slots.compact()
