"""velox_bench.probes.decode_step_compare, briefly: every asked method is timed beside Rotating,
and ``full`` (mlx-lm's KVCache) grows a row a step as SnapKV does after its cut."""

from __future__ import annotations

import mlx.core as mx
import pytest

from velox_bench.probes import decode_step_compare as probe


def test_full_grows_like_snapkv_after_its_cut() -> None:
    caches = {m: probe.make(m) for m in ("snapkv", "full")}
    n = probe.BUDGET + 8
    k, v = (
        mx.random.normal((1, probe.H_KV, n, probe.D)),
        mx.random.normal((1, probe.H_KV, n, probe.D)),
    )
    q = mx.random.normal((1, probe.H_Q, n, probe.D))
    for cache in caches.values():
        probe.step(cache, k, v, q)
    caches["snapkv"].finish_prefill()
    kept = caches["snapkv"].tokens_kept
    for _ in range(3):
        k1, v1 = (
            mx.random.normal((1, probe.H_KV, 1, probe.D)),
            mx.random.normal((1, probe.H_KV, 1, probe.D)),
        )
        q1 = mx.random.normal((1, probe.H_Q, 1, probe.D))
        for cache in caches.values():
            probe.step(cache, k1, v1, q1)
    assert caches["full"].offset == n + 3
    assert caches["snapkv"].tokens_kept == kept + 3 and kept <= probe.BUDGET


def test_the_probe_prints_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    probe.main(["--rounds", "1", "--steps", "2", "--methods", "tova", "snapkv", "full"])
    rows = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line}
    assert {"rotating", "tova", "snapkv", "full"} <= rows
