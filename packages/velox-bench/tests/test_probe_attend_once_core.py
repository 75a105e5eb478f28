"""velox_bench.probes.attend_once_core: the timed ops compute what the probe says they do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox_bench.probes import attend_once_core as probe


def _inputs() -> tuple[mx.array, ...]:
    mx.random.seed(0)
    q = mx.random.normal((probe.B, probe.H_Q, 1, probe.D))
    k = mx.random.normal((probe.B, probe.H_KV, probe.N, probe.D))
    v = mx.random.normal((probe.B, probe.H_KV, probe.N, probe.D))
    p = mx.broadcast_to(mx.arange(probe.N, dtype=mx.int32), (probe.B, 1, probe.N))
    return q, k, v, p


def test_the_cores_attend_as_sdpa_and_pick_the_lowest_weight() -> None:
    q, k, v, p = _inputs()
    (want,) = probe.sdpa(q, k, v, p)
    out, victim = probe.tova_core(q, k, v, p)
    np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-5)
    # TOVA: the layer's mean weight (float64 reference), lowest outside the 4 sinks
    logits = (
        np.einsum(
            "hgd,hnd->hgn",
            np.array(q, np.float64)[0, :, 0].reshape(probe.H_KV, -1, probe.D),
            np.array(k, np.float64)[0],
        )
        * probe.SCALE
    )
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    mean = w.reshape(-1, probe.N).mean(0)
    assert int(np.array(victim).reshape(-1)[0]) == probe.N_SINK + int(
        np.argmin(mean[probe.N_SINK :])
    )
    for core in (probe.adapted_core, mx.compile(probe.adapted_core)):
        out, victim = core(q, k, v, p)
        np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-6)
        # tova_adapted: the newest key as the probe, one decision per KV head
        kk = np.array(k, np.float64)[0]
        logits = np.einsum("hd,hnd->hn", kk[:, -1], kk) * probe.SCALE
        w = np.exp(logits - logits.max(-1, keepdims=True))
        expect = probe.N_SINK + np.argmin(w[:, probe.N_SINK :], axis=-1)
        assert np.array(victim).reshape(-1).tolist() == expect.tolist()


def test_the_probe_prints_every_op(capsys: pytest.CaptureFixture[str]) -> None:
    probe.main(["--rounds", "1", "--reps", "2"])
    out = capsys.readouterr().out
    for name in ("sdpa", "tova core", "adapted core", "adapted core, compiled"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
