"""velox_bench.probes.graph_nodes: its node count sees a cache's whole call, and its split of a
layer's decode call times the compiled decision call where the step runs it."""

from __future__ import annotations

import numpy as np
import pytest

from velox_bench.probes import graph_nodes as probe
from velox_bench.probes import layer_host_compare as lhc
from velox_cache_core import fast_step


def test_kvcache_call_nodes_count_its_attention() -> None:
    rng = np.random.default_rng(0)
    subject = lhc._Subject("KVCache", rng)
    # the store's update and attention's matmuls, softmax: more than a handful of nodes
    assert probe.call_nodes(subject, rng, 1) > 8


def test_kernel_share_times_the_compiled_call_inside_each_step() -> None:
    whole, inside, nodes = probe.kernel_share("tova", np.random.default_rng(0), steps=5)
    assert 0 < inside < whole
    assert nodes > 16  # more than KVCache's whole call: the decision's scoring and selection
    # the kernels are shared by every layer of the key (and every later cache): the timing
    # wrappers are taken out again
    tables = [kernels.decide for kernels in fast_step._KERNELS.values()]
    assert all(k.__name__ != "timed" for table in tables for k, _ in table.values())


def test_kernel_share_refuses_a_step_without_a_decision() -> None:
    # SnapKV after its cut only appends: no compiled decision call to time
    with pytest.raises(ValueError, match="snapkv decides nothing"):
        probe.kernel_share("snapkv", np.random.default_rng(0), steps=2)
