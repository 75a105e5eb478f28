"""The Qwen2.5-Coder-1.5B instrument's grid (`nox -s bench -- instrument`).

Hours of machine time, so the full grid runs only with ``VELOX_INSTRUMENT=full``: it is
``python -m velox_bench.instrument`` (resumable: cells already in
benchmarks/results/instrument_qwen2.5-coder-1.5b.jsonl are skipped; ``VELOX_INSTRUMENT_ONLY``
and ``VELOX_INSTRUMENT_CELLS`` narrow it as ``--only`` and ``--max-cells`` do). Without it, the
``--quick`` grid on a tiny random qwen2 model runs and writes nothing to the repository.
"""

import os
from pathlib import Path

import pytest

from velox_bench import instrument

pytestmark = [pytest.mark.quality, pytest.mark.slow, pytest.mark.corpus]

FULL = os.environ.get("VELOX_INSTRUMENT") == "full"


def test_instrument(tmp_path: Path) -> None:
    if FULL:
        argv = [
            "--only", os.environ.get("VELOX_INSTRUMENT_ONLY", ""),
            "--max-cells", os.environ.get("VELOX_INSTRUMENT_CELLS", "0"),
        ]  # fmt: skip
    else:
        argv = ["--quick", "--out", str(tmp_path / "quick.jsonl")]
    assert instrument.main(argv) == 0
