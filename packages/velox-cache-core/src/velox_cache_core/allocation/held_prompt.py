"""``head`` and ``global`` allocation around a policy that evicts at every decode step.

Under ``allocation="head"`` or ``"global"`` (scope ``head``) such a policy holds its prompt
whole: its rule keeps every row and remembers the prompt's last probe row (:func:`last_probe`).
At the first single-token call the held rows are cut into per-head shares by the policy's
prompt scores (each head keeps its protected rows and at least ``allocation_floor`` of its
uniform share, with one dead row for the next token), and every step after that evicts within
each head's share by the policy's step scores: the engine's lanes path
(:class:`~velox_cache_core.lanes.LaneRule`). Under ``global`` the first single-token call of
any layer cuts every linked layer at once (:class:`~velox_cache_core.lanes.GlobalRule`, driven
by :class:`~velox_cache_core.model_shares.ModelShares`).

The wrapped state declares ``budget``, ``allocation``, ``allocation_floor``, ``history`` (the
last probe row while the prompt is held) and ``lanes`` as fields.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any

import mlx.core as mx

from velox_cache_core import lanes
from velox_cache_core.allocation import shares
from velox_cache_core.engine import Call
from velox_cache_core.history import History
from velox_cache_core.store.slots import KVSlots


def holding(state: Any) -> bool:
    """Whether ``state`` holds its prompt whole for an adaptive cut at its end (not cut yet):
    a ``head``/``global`` allocation with no lanes yet and a probe row recorded (or no call
    at all)."""
    held = state.slots is None or state.history is not None
    return bool(state.allocation != "uniform" and state.lanes is None and held)


def last_probe(state: Any, call: Call) -> History:
    """The call's last probe row (by the state's ``signal``), which the held prompt keeps: the
    rule of a held prompt records it as ``history``."""
    probe = call.probe(state.signal)
    return History(probe[:, :, -1:], call.positions()[-1:])


@dataclass(frozen=True)
class HeldPrompt:
    """A policy's scores, wrapped into its ``head``/``global`` allocation.

    name: the policy's name (errors name it).
    ready(state): whether the held state has what scores its prompt (TOVA: the last probe
    row; H2O: the attention sums).
    prompt_scores(state, live): float ``[B, H, n]``, the scores the held rows ``live`` are
    shared out by (the highest kept).
    protect, step_scores: the :class:`~velox_cache_core.lanes.LaneRule`'s ``protect`` (which
    spares rows from the cut too) and ``score``.
    keep_scores: whether the lanes carry the prompt scores on as running scores (H2O's sums).
    cleared: running fields the cut resets besides ``history`` (it moves them into the lanes
    or drops them).
    prepare(state, call): the held state before the first single-token call cuts it (TOVA
    takes that call's scale when the prompt gave none), or ``None``.
    """

    name: str
    ready: Callable[[Any], bool]
    prompt_scores: Callable[[Any, KVSlots], mx.array]
    protect: Callable[[Any, mx.array, Any], mx.array]
    step_scores: Callable[[Any, lanes.Lanes, mx.array | None], tuple[mx.array, mx.array | None]]
    keep_scores: bool
    cleared: Mapping[str, Any] = field(default_factory=dict)
    prepare: Callable[[Any, Call], Any] | None = None

    def scores(self, state: Any) -> tuple[KVSlots, mx.array, mx.array] | None:
        """The held rows, their prompt scores and the rows the cut spares, or ``None`` when
        nothing is to cut (not held, nothing to score by, within ``budget``)."""
        if not holding(state) or state.slots is None or not self.ready(state):
            return None
        live = state.slots.compact()
        if live.n_slots <= state.budget:
            return None
        scores = self.prompt_scores(state, live)
        return live, scores, self.protect(state, live.positions, state.offset)

    def cut(self, state: Any, total: int | None) -> Any:
        """The held prompt cut into per-head shares (``total``: the layer's rows under
        ``global``; ``None``: ``budget * H``), lanes with one dead row per head; a prompt
        within ``budget`` is not cut (the policy goes on uniformly)."""
        found = self.scores(state)
        if found is None:
            return replace(state, history=None) if holding(state) else state
        live, scores, _ = found
        return shares.cut_evicting(
            state,
            live,
            scores,
            lambda positions: self.protect(state, positions, state.offset),
            name=self.name,
            keep_scores=self.keep_scores,
            total=total,
            history=None,
            **self.cleared,
        )

    def cut_at(self, state: Any, call: Call) -> Any:
        """The held prompt cut at its end, the first single-token call ``call``."""
        return self.cut(state if self.prepare is None else self.prepare(state, call), None)

    def lane_rule(self) -> lanes.LaneRule:
        """The policy's decisions over lanes (its record's ``lane_rule``; rows scored by the
        state's ``signal``)."""
        signal = attrgetter("signal")
        return lanes.LaneRule(self.cut_at, signal, self.protect, self.step_scores)

    def global_rule(self) -> lanes.GlobalRule:
        """The policy's part in a model-wide cut (its record's ``global_rule``)."""
        return lanes.GlobalRule(
            pending=holding, scores=self.scores, cut=self.cut, spare=2, when="first_token"
        )
