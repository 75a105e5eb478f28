"""A model-wide (``global``) allocation for policies whose cut runs in one layer.

SnapKV, Expected Attention, TOVA and H2O decide their cut inside each layer, which never sees
the other layers' scores. :class:`ModelShares` links the layers of one model (one
:class:`~velox_cache_core.layer.Layer` each; ``velox_mlx_lm``'s builder links them) and cuts
them all at once when the prompt has ended everywhere:

- ``when == "prompt_end"`` (SnapKV, Expected Attention): each layer *arrives* at its prompt end
  and keeps its prompt; the last layer to arrive cuts every layer (within the same forward pass
  as the prompt's last token, so no layer sees another call in between);
- ``when == "first_token"`` (TOVA, H2O): the first single-token call of any layer cuts every
  layer before it is laid out (every layer then holds its whole prompt).

The cut (:meth:`ModelShares.cut_all`): each layer's rows and scores
(:attr:`~velox_cache_core.lanes.GlobalRule.scores`), every head's floor first, then one
threshold over every other score of every head of every layer
(:func:`~velox_cache_core.allocation.shares.global_totals`, ``budget`` rows per head on
average, each layer's total in whole lanes), then each layer cut to its total. Every new state
is computed before any is taken, so an error leaves every layer as it was. One sequence only
(batch 1).
"""

from __future__ import annotations

from typing import Any

from velox_cache_core.allocation import shares


class ModelShares:
    """The layers of one model that share a ``global`` allocation."""

    def __init__(self) -> None:
        self.layers: list[Any] = []
        self.arrived: set[int] = set()  # indices of the layers whose prompt has ended

    def join(self, layer: Any) -> None:
        """Link ``layer`` (a :class:`~velox_cache_core.layer.Layer` whose policy declares a
        :class:`~velox_cache_core.lanes.GlobalRule`)."""
        if layer.policy.global_rule is None:
            raise ValueError(f"policy {layer.policy.name!r} declares no global allocation rule")
        if any(other is layer for other in self.layers):
            return
        self.layers.append(layer)
        layer.shares = self

    def arrive(self, layer: Any) -> None:
        """``layer``'s prompt has ended (its state holds the prompt); the last layer to arrive
        cuts them all."""
        index = next(i for i, other in enumerate(self.layers) if other is layer)
        self.arrived.add(index)
        if len(self.arrived) == len(self.layers):
            self.cut_all()

    def cut_all(self) -> None:
        """Cut every linked layer by one model-wide threshold (see the module doc)."""
        rules = [layer.policy.global_rule for layer in self.layers]
        for layer in self.layers:
            if layer.pending is not None:
                layer.settle()
        states = [layer.state for layer in self.layers]
        parts = [rule.scores(state) for rule, state in zip(rules, states, strict=True)]
        if all(part is None for part in parts):
            totals: list[int | None] = [None] * len(parts)
        elif any(part is None for part in parts):
            raise ValueError(
                "allocation='global': some layers hold a prompt within budget and others "
                "one over it; their prompts must be the same"
            )
        else:
            totals = list(self._totals(states, parts, max(rule.spare for rule in rules)))
        cut = [rule.cut(s, t) for rule, s, t in zip(rules, states, totals, strict=True)]
        for layer, state in zip(self.layers, cut, strict=True):
            layer.take_cut(state)
        self.arrived.clear()

    @staticmethod
    def _totals(states: list[Any], parts: list[Any], spare: int) -> list[int]:
        budgets = {int(state.budget) for state in states}
        floors = {float(state.allocation_floor) for state in states}
        if len(budgets) != 1 or len(floors) != 1:
            raise ValueError(
                "allocation='global' shares one budget: every linked layer needs the same "
                f"budget and allocation_floor, got {sorted(budgets)} and {sorted(floors)}"
            )
        lives, scores, protected = zip(*parts, strict=True)
        if any(int(live.positions.shape[0]) != 1 for live in lives):
            raise ValueError(
                "allocation='global' cuts one sequence (batch size 1): use 'head' or "
                "'uniform' for a batch"
            )
        budget, floor = budgets.pop(), floors.pop()
        least = shares.least_rows(budget, floor, protected, spare)
        positions = [live.positions for live in lives]
        width = shares.lane_width(budget)
        return shares.global_totals(list(scores), positions, list(protected), budget, least, width)


def cut_globally(layer: Any, when: str) -> bool:
    """``Layer._cut_globally``: at ``when``, a layer's state awaiting a model-wide cut
    (``allocation="global"``) takes part in it: ``"first_token"`` cuts every linked layer now,
    ``"prompt_end"`` arrives (the last layer to arrive cuts them all). Returns whether it
    did."""
    rule, state = layer.policy.global_rule, layer.state
    if rule is None or rule.when != when or state.allocation != "global" or not rule.pending(state):
        return False
    if layer.shares is None:
        raise ValueError(shares.UNLINKED.format(name=layer.policy.name))
    if when == "first_token":
        layer.shares.cut_all()
    else:
        layer.shares.arrive(layer)
    return True
