"""velox_bench.probes.undo_memory at a small size: a method with a probe window (MorphKV) holds
about what it reports."""

from __future__ import annotations

from velox_bench.probes import undo_memory
from velox_bench.probes.held import without_buffer_cache


def test_a_small_model_is_measured() -> None:
    r = undo_memory.measure("morphkv", budget=64, steps=4)
    assert r["held"] > 0 and r["undo_nbytes"] > 0
    assert r["nbytes"] < r["held_nbytes"] and r["held"] <= 1.1 * r["held_nbytes"]


def test_without_the_buffer_cache_8_bit_rows_hold_what_they_report() -> None:
    with without_buffer_cache():
        r = undo_memory.measure("h2o", budget=64, steps=4, kv_bits=8)
    assert r["held_nbytes"] <= 1.05 * r["held"] and r["held"] <= 1.05 * r["held_nbytes"]
