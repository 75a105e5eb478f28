"""KVzip's kept-share-by-depth diagnostic: its two readers on hand-made caches, and a CI-sized
run through pytest as `nox -s bench -- kvzip_depth` runs it (the real prefill and
reconstruction pass on one short document)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest


def _cache(positions: list[list[int]]) -> Any:
    return SimpleNamespace(policy_state=SimpleNamespace(positions=np.array([positions])))


def test_kept_share_counts_heads_and_leaves_pads_out() -> None:
    from velox_bench.quality.kvzip_depth import kept_share

    pad = 2**30
    share = kept_share([_cache([[0, 2, pad], [2, 3, 1]]), _cache([[4, 3, 2], [0, 1, 2]])], 5)
    want = [[0.5, 0.5, 1.0, 0.5, 0.0], [0.5, 0.5, 1.0, 0.5, 0.5]]
    np.testing.assert_allclose(share, want)


def test_answer_positions_covers_every_mention() -> None:
    from velox_bench.quality.kvzip_depth import answer_positions

    assert answer_positions([5, 1, 2, 9, 1, 2], [1, 2]) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="do not occur"):
        answer_positions([5, 1, 9], [1, 2])


@pytest.mark.quality
@pytest.mark.model
@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.usefixtures("embedded_corpus")
def test_kvzip_depth_smoke(tmp_path: Path, run_bench_smoke: Any) -> None:
    run_bench_smoke("test_kvzip_depth.py")
    out = json.loads((tmp_path / "kvzip_depth.json").read_text())
    assert out["smoke"] is True and out["document"]["trials"] == 1
    assert out["document"]["tokens"] > out["settings"]["budget"]
    row = out["deciles"]["global"]
    assert len(row) == 10 and all(0.0 <= x <= 1.0 for x in row)
    assert set(out["facts"]["global"]) == {"0.1", "0.5", "0.9"}
    assert out["kept_mean"]["global"] == pytest.approx(out["even"], abs=1e-6)
    assert (tmp_path / "figures" / "kvzip_depth.png").stat().st_size > 0
