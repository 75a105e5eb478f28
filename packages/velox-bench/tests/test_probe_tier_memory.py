"""velox_bench.probes.tier_memory at a small size: dropping the last call's copies once it is
attended holds less than keeping them."""

from __future__ import annotations

from velox_bench.probes import tier_memory


def test_a_small_layer_is_measured() -> None:
    kept = tier_memory.measure("tova", 4, 16, budget=64, rows=128, steps=3, release=False)
    released = tier_memory.measure("tova", 4, 16, budget=64, rows=128, steps=3, release=True)
    for r in (kept, released):
        assert r["held"] > 0 and r["nbytes"] > 0 and r["log"] > 0
    assert released["held"] < kept["held"]
