"""Decode step with quantized rows (`nox -s bench -- quantized_decode`): one layer of a Velox
TOVA cache (budget 512, 4 and 8 bits) against mlx-lm's QuantizedKVCache plus its quantized
attention at the same width, timed in alternation, at a context within the budget (256) and
at 8k (issue 30); keys per token (mlx-lm's layout) and per channel (kv_key_layout="channel",
against mlx-lm's per-token cache of the same width). Writes
benchmarks/results/quantized_decode.json; ``VELOX_BENCH_SMOKE=1`` runs a tiny case."""

# conftest.py beside this file loads OpenBLAS before anything imports mlx.
from typing import Any

from velox_bench.results import smoke, write_json


def test_quantized_decode(benchmark: Any) -> None:
    from velox_bench.quantized_decode import Case, compare

    if smoke():
        small = {"budget": 16, "h_kv": 2, "h_q": 4, "d": 64}
        cases = [Case(context=c, **small) for c in (8, 48)]
        cases += [Case(context=80, layout="channel", group=32, **small)]
        rounds = 2
    else:
        cases = [Case(context=c, bits=b) for b in (4, 8) for c in (256, 8192)]
        cases += [Case(context=c, bits=b, layout="channel") for b in (4, 2) for c in (256, 8192)]
        rounds = 30

    def run() -> list[dict[str, Any]]:
        return [compare(case, rounds=rounds) for case in cases]

    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    print()
    print(f"{'bits':>5}{'keys':>9}{'context':>9}{'velox ms':>10}{'mlx ms':>9}{'ratio':>7}")
    for r in rows:
        c, m = r["case"], r["median_s"]
        print(
            f"{c['bits']:>5}{c['layout']:>9}{c['context']:>9}{m['velox'] * 1e3:>10.3f}"
            f"{m['mlx'] * 1e3:>9.3f}{r['ratio']:>7.2f}"
        )
    print(f"wrote {write_json('quantized_decode', {'smoke': smoke(), 'rows': rows})}")
    assert all(r["median_s"]["velox"] > 0 and r["median_s"]["mlx"] > 0 for r in rows)
