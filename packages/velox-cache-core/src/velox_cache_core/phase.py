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
from velox_cache_core.masks import chunk_causal
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_fits


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
            mx.concatenate([rows.dense(live.keys), keys.astype(live.keys.dtype)], axis=2),
            mx.concatenate([rows.dense(live.values), values.astype(live.values.dtype)], axis=2),
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
        all_keys = mx.concatenate([rows.dense(live.keys), keys.astype(dtype)], axis=2)
        all_values = mx.concatenate([rows.dense(live.values), values.astype(dtype)], axis=2)
        L = int(keys.shape[2])
        causal = None if L == 1 else chunk_causal(live.n_slots, L)[None, None]
        return mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=scale, mask=causal, sinks=sinks
        ).astype(queries.dtype)


def _live(state: Any, name: str) -> KVSlots:
    if state.slots is None:
        raise ValueError(f"the {name} cache holds no context to score")
    return state.slots.compact()


# -- a layer's phase (velox_cache_core.layer.Layer's methods of these names) -------------------
def layer_compressor(layer: Any) -> Compressor:
    """The layer's policy's model-driven phase (``ValueError`` when it declares none)."""
    return compressor_of(layer.policy)


def start_phase(layer: Any) -> None:
    """Enter the phase (the context must be whole: not compressed yet)."""
    compressor = compressor_of(layer.policy)
    layer.settle()
    compressor.check(layer.state)  # raises on a compressed or empty state
    layer.phase = Phase()


def score_chunk(layer: Any, start: int, end: int) -> None:
    """The next forward pass scores context rows ``start..end-1``."""
    _in_phase(layer, "score_chunk").chunk = (start, end)


def phase_scores(layer: Any) -> mx.array:
    """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
    if layer.phase is None:
        raise ValueError("no chunk of the scoring pass was scored")
    scores: mx.array = layer.phase.all_scores()
    return scores


def finish_phase(layer: Any, budget: int | None = None, total: int | None = None) -> None:
    """Leave the phase: cut the context by every chunk's scores (to ``budget`` if given;
    ``total``: the layer's share of a model-wide row total)."""
    scores = _in_phase(layer, "finish_phase").all_scores()
    state = layer.policy.rebudget(layer.state, budget)
    state = compressor_of(layer.policy).cut(state, scores, total)  # raises: unchanged
    layer.phase = None
    layer.take_cut(state)


def abort_phase(layer: Any) -> None:
    """Leave the phase uncompressed (after an error in the pass)."""
    layer.phase = None


def _in_phase(layer: Any, what: str) -> Phase:
    if layer.phase is None:
        raise RuntimeError(f"{what}() outside the scoring phase (call start_phase())")
    phase: Phase = layer.phase
    return phase
