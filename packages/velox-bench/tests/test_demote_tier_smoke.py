"""``python -m velox_bench.quality.demote_tier``: the equal-bytes arithmetic, and its perplexity
and decode-step parts run small (a random llama with head_dim 64; the real run uses the
embedded model and writes benchmarks/results/demote_tier.json)."""

from __future__ import annotations

import numpy as np

from velox_bench.models import random_llama
from velox_bench.quality import demote_tier as dt
from velox_cache_core import TierSpec


def test_tier_rows_fill_the_bytes_of_the_rows_they_replace() -> None:
    for budget, main, bits in ((512, 256, 2), (512, 256, 4), (160, 80, 2), (1024, 512, 2)):
        rows = dt.tier_rows(budget, main, bits, 64, 4)
        left = (budget - main) * 2 * 64 * 4
        assert TierSpec(bits, rows, dt.GROUP).max_nbytes(1, 64, 4) <= left
        assert TierSpec(bits, rows + 1, dt.GROUP).max_nbytes(1, 64, 4) > left
    # a 2-bit tier holds more rows than a 4-bit one in the same bytes
    assert dt.tier_rows(512, 256, 2, 64, 4) > dt.tier_rows(512, 256, 4, 64, 4) > 256
    # the window of a group's full-precision keys does not fit in 8 rows' bytes
    assert dt.tier_rows(16, 8, 2, 64, 4) == 0
    labels = [r[0] for r in dt.runs(512, 64, 4)]
    assert labels == ["fp", "8-bit", "fp + tier 2", "fp + tier 4"]


def test_perplexity_part_on_a_random_model() -> None:
    model = random_llama(2, 256, 4, 2, intermediate=128, vocab=128)  # head_dim 64
    tokens = np.random.default_rng(0).integers(0, 128, size=241).tolist()
    settings = dt.TierSettings(methods=("h2o",), budget=192, tokens=240, chunk=60)
    out = dt.perplexity_part(model, tokens, settings, lambda n: None)
    rows = {(r["method"], r["label"]): r for r in out["rows"]}
    assert set(rows) == {
        (m, lab) for m in ("h2o",) for lab in ("fp", "8-bit", "fp + tier 2", "fp + tier 4")
    }
    fp, tier = rows[("h2o", "fp")], rows[("h2o", "fp + tier 2")]
    assert tier["budget"] == 96 and tier["tier_rows"] > 0
    assert tier["kv_bytes"] <= fp["kv_bytes"]  # the held bytes, read from the caches
    assert all(np.isfinite(r["ppl"]) for r in out["rows"])
    text = dt.summary({"settings": {"budget": 192}, "perplexity": out})
    assert "h2o fp + tier 2" in text


def test_step_part_times_both_layers() -> None:
    settings = dt.TierSettings(methods=("tova",), budget=128, step_rounds=1, step_steps=2)
    rows = dt.step_part(settings)
    assert [r["bits"] for r in rows] == [2, 4]
    for row in rows:
        assert row["rows_with"] == 64 + row["tier_rows"] and row["rows_without"] == 128
        assert row["ratio"] > 0
