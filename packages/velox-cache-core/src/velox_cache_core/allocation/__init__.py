"""How a policy's budget is shared among its heads: ``uniform``, ``head`` (AdaKV) or ``global``.

``uniform`` keeps ``budget`` rows per KV head: the policy's own rule, unwrapped. ``head`` and
``global`` share rows by the policy's scores: ``head`` a layer's ``budget * H_kv`` rows across
its heads, ``global`` the model's rows across every head of every layer (the layers linked by a
:class:`~velox_cache_core.model_shares.ModelShares`). Each head keeps at least
``allocation_floor`` of its uniform share, and its rows are held as lanes
(:mod:`velox_cache_core.lanes`), which the engine decides over at every step.

A policy takes part by declaring what its scores are, not by carrying the cut itself:

- a policy that evicts at every decode step (TOVA, H2O) is wrapped by :class:`HeldPrompt`
  (:mod:`~velox_cache_core.allocation.held_prompt`), which gives its record's ``lane_rule``
  and ``global_rule``;
- a policy whose cut runs at its prompt end (SnapKV, Expected Attention, KVzip) calls
  :func:`~velox_cache_core.allocation.shares.cut_into_lanes` or
  :func:`~velox_cache_core.allocation.shares.cut_evicting` from its own cut and declares a
  ``GlobalRule`` for its scores.

:mod:`~velox_cache_core.allocation.shares` computes the shares and cuts the rows into lanes.
"""

from __future__ import annotations

from velox_cache_core.allocation.held_prompt import HeldPrompt, holding, last_probe

__all__ = ["HeldPrompt", "holding", "last_probe"]
