"""velox_bench.probes.tier_memory at a small size: every case is measured and held > 0."""

from __future__ import annotations

from velox_bench.probes import tier_memory


def test_a_small_layer_is_measured() -> None:
    r = tier_memory.measure("tova", 4, 16, budget=64, rows=128, steps=3)
    assert r["held"] > 0 and r["nbytes"] > 0 and r["log"] > 0
    assert r["held / (nbytes + log)"] > 0
