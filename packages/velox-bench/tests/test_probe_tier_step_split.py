"""velox_bench.probes.tier_step_split at a tiny budget: every part runs and is timed."""

from __future__ import annotations

import pytest

from velox_bench.probes import tier_step_split


def test_every_part_is_timed(capsys: pytest.CaptureFixture[str]) -> None:
    assert tier_step_split.main(["--budget", "128", "--rounds", "1", "--bits", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 8
    assert all(float(line.split()[-1]) > 0 for line in lines)
    with pytest.raises(SystemExit):
        tier_step_split.main(["--budget", "7"])
    with pytest.raises(SystemExit):
        tier_step_split.main(["--budget", "64"])  # no room for a tier
