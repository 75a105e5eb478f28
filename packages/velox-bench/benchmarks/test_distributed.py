"""Tensor-parallel decode with Velox caches: what the layer-scope all-reduce costs.

Two ranks of this host (``mlx.launch --backend ring -n 2``) split a random llama with a real
attention shape (32 query / 8 KV heads, head_dim 64, hidden 2048, 4 layers) by ``model.shard``;
after a 2,048-token prompt they time greedy decode steps, interleaved in rounds, of mlx-lm's
full ``KVCache``, TOVA(512) with layer scope (the all-reduce on), TOVA(512) with head scope
(rank-local), and layer scope with the all-reduce off. Goal (issue 16): layer scope costs at
most 10% of a decode step over head scope. Reported, not asserted (wall-clock time on a shared
machine). The runner is ``velox_bench.distributed_bench``.

Writes ``benchmarks/results/distributed.json``. ``VELOX_BENCH_SMOKE=1``: a tiny llama, a few
steps.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from velox_bench.distributed_bench import launch, table
from velox_bench.results import results_dir, smoke


def test_distributed_suite() -> None:
    if not mx.distributed.is_available():
        pytest.skip("mx.distributed has no backend in this MLX build")
    path = results_dir() / "distributed.json"
    payload = launch(path, ranks=2, smoke=smoke())
    # The layer-scope decision is taken once for all ranks: they keep the same rows.
    assert payload["results"]["tova_layer"]["ranks_agree"]
    print()
    print(table(payload))
    print(f"velox-bench: wrote {path}")
