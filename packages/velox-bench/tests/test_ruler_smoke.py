"""The RULER-style task generator (velox_bench.quality.ruler): seeded, the lengths asked, the
answers planted; and one short run of every task on the embedded model (the full grid is
`nox -s bench -- ruler`)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.corpus]


def words(text: str) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return list(range(len(text.split())))


@pytest.fixture(scope="module")
def ruler() -> Any:
    from velox_bench.quality import corpus, ruler

    try:
        corpus.speeches_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return ruler


@pytest.mark.parametrize("kind", ["multikey", "multivalue", "variable_tracking", "common_words"])
def test_tasks_are_seeded_sized_and_answerable(ruler: Any, kind: str) -> None:
    task = ruler.make_task(kind, 2048, 3, words)
    assert task == ruler.make_task(kind, 2048, 3, words)  # the same every time
    assert task.context != ruler.make_task(kind, 2048, 4, words).context
    assert 1900 <= len(words(task.context)) <= 2048
    assert task.answers and all(a in task.context for a in task.answers)
    assert ruler.score(task, " ".join(task.answers)) == 1.0
    assert ruler.score(task, "no idea") == 0.0
    assert task.prompt().endswith(task.primer)


def test_variable_chain_in_order_and_common_words_counted(ruler: Any) -> None:
    task = ruler.make_task("variable_tracking", 1024, 0, words)
    names = [task.context.index(f"VAR {name} =") for name in task.answers]
    assert names == sorted(names)  # each assignment after the one it copies
    task = ruler.make_task("common_words", 2048, 0, words)
    counts = Counter(re.findall(r"\d+\. (\w+)", task.context))
    assert {w for w, _ in counts.most_common(10)} == set(task.answers)
    assert set(counts[w] for w in task.answers) == {30}
    assert set(counts.values()) == {30, 3}
    short = ruler.make_task("common_words", 256, 0, words)  # fewer repeats, within 256
    assert len(words(short.context)) <= 256


def test_unknown_task(ruler: Any) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        ruler.make_task("needle", 1024, 0, words)


@pytest.mark.model
@pytest.mark.slow
def test_every_task_runs_on_the_embedded_model(
    ruler: Any, run_bench_smoke: Callable[..., Any]
) -> None:
    """``benchmarks/test_ruler.py`` with VELOX_BENCH_SMOKE=1: one 256-token sample of each task
    on SmolLM2 with TOVA(64), 4 tokens each."""
    from velox_mlx_lm.embedded import ModelNotFoundError, default_model_path

    try:
        default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    proc = run_bench_smoke("test_ruler.py", extra=("-s",))
    assert "1 passed" in proc.stdout


def test_report_means_per_run_task_and_length(tmp_path: Any) -> None:
    """ruler_report averages the samples of each cell and writes a table and a figure."""
    from velox_bench.quality import ruler_report

    def row(method: str, budget: int | None, task: str, length: int, seed: int, s: float) -> Any:
        return {
            "model": "m",
            "method": method,
            "budget": budget,
            "task": task,
            "length": length,
            "seed": seed,
            "score": s,
            "seconds": 30.0,
        }

    rows = [
        row("full", None, "multikey", 2048, 0, 1.0),
        row("full", None, "multikey", 2048, 1, 0.0),
        row("full", None, "multikey", 4096, 0, 1.0),
        row("tova", 256, "multikey", 2048, 0, 0.25),
        row("tova", 256, "multikey", 2048, 1, 0.75),
        row("tova", 256, "common_words", 4096, 0, 0.5),
        row("other", 1, "multikey", 2048, 0, 1.0),
    ]
    found, counts = ruler_report.means(rows[:-1], "m")
    assert found[("full", None)] == {("multikey", 2048): 0.5, ("multikey", 4096): 1.0}
    assert found[("tova", 256)][("multikey", 2048)] == 0.5
    assert counts[("multikey", 2048)] == 2
    text = ruler_report.markdown(rows[:-1])
    assert "| full | 0.50 / 1.00 | - / - | 0.50 / 1.00 |" in text
    assert "| tova (256) | 0.50 / - | - / 0.50 | 0.50 / 0.50 |" in text
    assert "multikey (2k / 4k)" in text and "common_words (2k / 4k)" in text
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(
        "a\n<!-- ruler:start -->\nold\n<!-- ruler:end -->\nb\n"
    )
    ruler_report.write(rows[:-1], tmp_path)
    doc = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "old" not in doc and "| tova (256) |" in doc and doc.endswith("b\n")
    assert (tmp_path / "docs" / "figures" / "ruler_m.png").stat().st_size > 0
