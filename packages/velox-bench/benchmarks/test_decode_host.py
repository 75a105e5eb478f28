"""Host and eval time per decode step (`nox -s bench -- decode_host`): every cache-only Velox
method against mlx-lm's KVCache and RotatingKVCache(budget, keep=4), side by side in one
process, rounds interleaved (``velox_bench.decode_host``).

Runs: the embedded SmolLM2-135M (context 700, budget 512; left out with a note when it is not
installed), the random llama of real shape (12 layers, hidden 768, 12/4 heads; context 700,
budget 512), and that llama after an 8k-token prompt (budget 512), where ``total_vs_rotating``
is each method's decode step over RotatingKVCache's. Writes
benchmarks/results/decode_host.json; ``VELOX_BENCH_SMOKE=1`` runs a tiny llama and short
prompts. Timings are reported, never asserted on."""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
from __future__ import annotations

from typing import Any

from velox_bench.results import smoke, write_json


def _plan() -> list[tuple[str, Any]]:
    """(model name, settings) per run, the long-prompt run last."""
    from velox_bench.decode_host import REAL_SHAPE, SMOKE_SETTINGS, SMOLLM2, Settings

    if smoke():
        long = Settings(**{**SMOKE_SETTINGS.__dict__, "context": 64})
        return [(SMOLLM2, SMOKE_SETTINGS), (REAL_SHAPE, SMOKE_SETTINGS), (REAL_SHAPE, long)]
    base = Settings(context=700, budget=512, steps=30, rounds=3)
    long = Settings(context=8192, budget=512, steps=30, rounds=3)
    return [(SMOLLM2, base), (REAL_SHAPE, base), (REAL_SHAPE, long)]


def _runs(notes: list[str]) -> list[dict[str, Any]]:
    from velox_bench.decode_host import load_model, measure
    from velox_mlx_lm.embedded import ModelNotFoundError

    runs = []
    models: dict[str, Any] = {}
    for name, settings in _plan():
        if name not in models:
            try:
                models[name] = load_model(name, small=smoke())
            except ModelNotFoundError as exc:
                notes.append(f"{name} left out: {exc}")
                models[name] = None
        if models[name] is not None:
            runs.append(measure(models[name], settings, progress=False))
    return runs


def _check(run: dict[str, Any]) -> None:
    """Structure only: a row per method, positive times, ratios against full and rotating,
    the fast-path fraction reported for every Velox row."""
    from velox_bench.decode_host import methods

    rows = {r["method"]: r for r in run["rows"]}
    assert list(rows) == methods()
    for r in rows.values():
        assert r["host_ms"] > 0 and r["eval_ms"] > 0 and r["timed_steps"] > 0
        assert r["flush_ms_per_step"] >= 0
        assert r["total_vs_full"] is not None and r["total_vs_rotating"] is not None
        fast = r["fast_path_fraction"]
        assert (fast is None) == r["baseline"]
        assert fast is None or 0 <= fast <= 1
    assert rows["full"]["host_vs_full"] == rows["full"]["eval_vs_full"] == 1


def test_decode_host(benchmark: Any) -> None:
    from velox_bench.decode_host import payload, table

    notes: list[str] = []
    runs = benchmark.pedantic(lambda: _runs(notes), rounds=1, iterations=1)
    print()
    for run in runs:
        print(table(run), end="\n\n")
    print("\n".join(notes))
    print(f"wrote {write_json('decode_host', payload(runs, notes))}")
    assert runs and runs[-1]["model"] == "real-shape"
    for run in runs:
        _check(run)
