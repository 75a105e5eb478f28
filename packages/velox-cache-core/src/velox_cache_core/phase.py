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
from velox_cache_core.validation import check_fits


@dataclass
class Phase:
    """The phase of one layer: ``scores`` float32 ``[B, H_kv, n_i]`` of the chunks so far,
    ``chunk`` the context rows ``[start, end)`` the next pass scores, ``recon`` the call in
    flight (attended to, never stored): its keys ``[B, H_kv, L, D]`` and what it attends over,
    keys and values ``[B, H_kv, n + L, D]``."""

    scores: list[mx.array] = field(default_factory=list)
    chunk: tuple[int, int] | None = None
    recon: tuple[mx.array, mx.array, mx.array] | None = None

    def all_scores(self) -> mx.array:
        """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
        if not self.scores:
            raise ValueError("no chunk of the scoring pass was scored")
        return mx.concatenate(self.scores, axis=-1)

    def lay_out(
        self, state: Any, name: str, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The context (dequantized) then the call's rows at full precision: what the call
        attends over, kept with the call's keys for :meth:`attend`."""
        if state.slots is None:
            raise ValueError(f"the {name} cache holds no context to score")
        live = state.slots.compact()
        check_fits(live, keys, values, stored=False)  # attended over, never stored
        over = (
            mx.concatenate([rows.dense(live.keys), keys.astype(live.keys.dtype)], axis=2),
            mx.concatenate([rows.dense(live.values), values.astype(live.values.dtype)], axis=2),
        )
        self.recon = (keys, *over)
        return over

    def attend(
        self, state: Any, policy: Any, queries: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        """``[B, H_q, L, D]``: score the chunk's context rows from ``queries``, then attend
        over the context and the call's rows (causal among them)."""
        if self.recon is None or self.chunk is None:
            raise RuntimeError("attend() in the scoring phase needs score_chunk() and a call")
        (keys, all_keys, all_values), self.recon = self.recon, None
        start, end = self.chunk
        self.scores.append(policy.compressor.score(state, queries, keys, start, end, scale))
        L = int(keys.shape[2])
        causal = None if L == 1 else chunk_causal(int(all_keys.shape[2]) - L, L)[None, None]
        return mx.fast.scaled_dot_product_attention(
            queries, all_keys, all_values, scale=scale, mask=causal, sinks=sinks
        ).astype(queries.dtype)


# -- a layer's phase (velox_cache_core.layer.Layer's methods of these names) -------------------
def layer_compressor(layer: Any) -> Compressor:
    """The layer's policy's model-driven phase (``ValueError`` when it declares none)."""
    compressor: Compressor | None = layer.policy.compressor
    if compressor is None:
        raise ValueError(f"policy {layer.policy.name!r} declares no model-driven phase")
    return compressor


def start_phase(layer: Any) -> None:
    """Enter the phase (the context must be whole: not compressed yet)."""
    compressor = layer_compressor(layer)
    layer.settle()
    compressor.check(layer.state)  # raises on a compressed or empty state
    layer.phase = Phase()


def score_chunk(layer: Any, start: int, end: int) -> None:
    """The next forward pass scores context rows ``start..end-1``."""
    _in_phase(layer, "score_chunk").chunk = (start, end)


def phase_scores(layer: Any) -> mx.array:
    """float32 ``[B, H_kv, n]``: every context row's score so far (the chunks, in order)."""
    phase: Phase | None = layer.phase
    if phase is None:
        raise ValueError("no chunk of the scoring pass was scored")
    return phase.all_scores()


def finish_phase(layer: Any, budget: int | None = None, total: int | None = None) -> None:
    """Leave the phase: cut the context by every chunk's scores (to ``budget`` if given;
    ``total``: the layer's share of a model-wide row total)."""
    scores = _in_phase(layer, "finish_phase").all_scores()
    state = layer.policy.rebudget(layer.state, budget)
    state = layer.policy.compressor.cut(state, scores, total)  # raises: unchanged
    layer.phase = None
    layer.take_cut(state)


def abort_phase(layer: Any) -> None:
    """Leave the phase uncompressed (after an error in the pass)."""
    layer.phase = None


def _in_phase(layer: Any, what: str) -> Phase:
    phase: Phase | None = layer.phase
    if phase is None:
        raise RuntimeError(f"{what}() outside the scoring phase (call start_phase())")
    return phase
