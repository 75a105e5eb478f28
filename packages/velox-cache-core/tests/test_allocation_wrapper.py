"""``head`` allocation wraps any policy's scores (:class:`velox_cache_core.allocation.HeldPrompt`).

TOVA's and H2O's ``head``/``global`` allocation is the wrapper around their scores (their
reference tests are ``test_tova_allocation.py`` and ``test_h2o_allocation.py``). Here a policy
the library does not ship, TOVA's decode rule with its held prompt cut by the keys' norms
instead of the last query's weights, gets the same allocation from the wrapper alone: the cut
keeps each head's share of the highest norms (NumPy reference), heads with larger keys get
more rows, and the decode steps after it hold at most the uniform cut's bytes.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
from core_reference_lanes import order, ref_shares

from velox_cache_core import POLICIES, KVSlots
from velox_cache_core import lanes as LN
from velox_cache_core.allocation import HeldPrompt, holding
from velox_cache_core.allocation import shares as AS
from velox_cache_core.selection import sinks

TOVA = POLICIES["tova"]


def _norms(state: object, live: KVSlots) -> mx.array:
    return mx.sqrt((live.keys.astype(mx.float32) ** 2).sum(axis=-1))  # [B, H, n]


KEY_NORMS = HeldPrompt(
    name="tova_key_norms",
    ready=lambda state: state.history is not None,
    prompt_scores=_norms,
    protect=lambda state, positions, newest: sinks(positions, state.n_sink),
    step_scores=lambda state, lanes, weights: (weights, None),
    keep_scores=False,
    cleared={"scale": None},
)
POLICY = dataclasses.replace(
    TOVA,
    name="tova_key_norms",
    lane_rule=KEY_NORMS.lane_rule(),
    global_rule=KEY_NORMS.global_rule(),
)


def test_the_wrapped_scores_decide_the_cut() -> None:
    B, H, g, D, budget, n_sink, floor = 1, 2, 2, 8, 8, 1, 0.2
    n, T = 30, 40
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((B, H, T, D)).astype(np.float32)
    keys[:, 0] *= 3.0  # head 0's keys are larger: its norms win the shares
    values = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = rng.standard_normal((B, H * g, T, D)).astype(np.float32)
    k, v, q = mx.array(keys), mx.array(values), mx.array(queries)
    state = POLICY.init_for(
        "tova",
        budget=budget,
        n_sink=n_sink,
        scope="head",
        allocation="head",
        allocation_floor=floor,
    )
    state = POLICY.update(state, k[:, :, :n], v[:, :, :n], q[:, :, :n]).state
    assert holding(state) and state.n_kept == n  # held whole

    assert POLICY.global_rule is not None
    cut = POLICY.global_rule.cut(state, None)  # what the next single-token call does first
    assert cut.lanes is not None and not holding(cut)
    norms = np.linalg.norm(keys[:, :, :n].astype(np.float64), axis=-1)
    positions = np.broadcast_to(np.arange(n), (B, H, n))
    protected = positions < n_sink
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, n_sink + 2, width)
    counts = ref_shares(norms, positions, protected, budget * H, least, width)
    got = [
        [sorted(p for p in head if p < LN.PAD) for head in row]
        for row in np.array(cut.positions).tolist()
    ]
    for h in range(H):
        kept = order(norms[0, h], positions[0, h], protected[0, h])[: counts[0, h]]
        dead = min((p for p in kept if p >= n_sink), key=lambda p: (norms[0, h, p], p))
        assert got[0][h] == sorted(p for p in kept if p != dead), h
    assert counts[0, 0] > counts[0, 1]  # the larger keys took the larger share

    for t in range(n, T):  # decode over the lanes: TOVA's rule within each head's share
        step = POLICY.update(state, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
        state = step.state
        assert state.lanes is not None
    assert state.nbytes <= B * H * (budget + 1) * 2 * D * 4


def test_a_policy_without_allocation_carries_no_lanes_field() -> None:
    for name, policy in POLICIES.items():
        fields = {f.name for f in dataclasses.fields(policy.state_type)}
        assert ("lanes" in fields) == ("allocation" in policy.setting_names), name
        assert policy.init_for(policy.methods[0]).lanes is None
