"""velox_bench.probes.shift_cost at a tiny size: every store is shifted and timed."""

from __future__ import annotations

import pytest

from velox_bench.probes import shift_cost


def test_shift_cost_times_every_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        shift_cost.main(["--heads", "1", "--rows", "9", "--tier-rows", "70", "--rounds", "2"]) == 0
    )
    out = capsys.readouterr().out
    for name in ("float32 (9)", "8-bit per token (9)", "2-bit (70)", "4-bit (70)"):
        line = next(line for line in out.splitlines() if name in line)
        assert float(line.split()[-1]) > 0
    with pytest.raises(SystemExit):
        shift_cost.main(["--dim", "32"])
