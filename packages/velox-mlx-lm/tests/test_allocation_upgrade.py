"""Prompt caches saved by 0.3 (KVzip's old allocation names, pad slots) load under the new
meaning: ``"head"`` (the equal cut) is ``"uniform"``, ``"layer"`` is ``"head"``, and pad slots
become lanes holding the same real rows."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np

from velox_cache_core import POLICIES
from velox_cache_core.policies.kvzip import PAD
from velox_cache_core.store.slots import KVSlots
from velox_mlx_lm import prompt_state

KVZIP = POLICIES["kvzip"]


def _old(state, allocation: str, padded: bool) -> dict:  # type: ignore[no-untyped-def]
    """``state`` encoded as 0.3 wrote it: a ``padded`` field and the old allocation name."""
    data = prompt_state.encode(state, None)
    meta = json.loads(data["meta"])
    meta.update(allocation=allocation, padded=padded)
    return {**data, "meta": json.dumps(meta)}


def test_old_names_load_under_the_new_meaning() -> None:
    state = replace(KVZIP.init(budget=8, allocation="uniform"), compressed=True)
    loaded, _ = prompt_state.decode(KVZIP, _old(state, "head", False))
    assert loaded.allocation == "uniform"
    loaded, _ = prompt_state.decode(KVZIP, _old(state, "layer", False))
    assert loaded.allocation == "head"


def test_pad_slots_become_lanes_with_the_same_rows() -> None:
    rng = np.random.default_rng(0)
    H, cap, D = 2, 6, 4
    keys = rng.standard_normal((1, H, cap, D)).astype(np.float32)
    values = rng.standard_normal((1, H, cap, D)).astype(np.float32)
    positions = np.tile(np.arange(cap, dtype=np.int32), (1, H, 1))
    positions[0, 1, 4:] = PAD  # head 1 kept 4 real rows, padded to 6
    keys[0, 1, 4:] = values[0, 1, 4:] = 0
    slots = KVSlots(mx.array(keys), mx.array(values), mx.array(positions))
    state = replace(
        KVZIP.init(budget=5, n_sink=1, allocation="uniform"), compressed=True, slots=slots, offset=9
    )
    loaded, _ = prompt_state.decode(KVZIP, _old(state, "layer", True))
    assert loaded.allocation == "head" and loaded.lanes is not None
    assert loaded.lanes.counts(H).tolist() == [[6, 4]]
    assert loaded.nbytes == 10 * 2 * D * 4  # the 10 real rows, no pads
    view = np.array(loaded.positions)
    assert sorted(view[0, 1][view[0, 1] < PAD].tolist()) == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.array(loaded.keys)[0, 0], keys[0, 0])
