"""velox_bench.probes.layer_host_compare: its subjects run the calls they name (the ``--cache``
pair: one deferring its writes, one not) and its table names every cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_bench.probes import layer_host_compare as probe


def test_cache_subjects_defer_or_write_as_named() -> None:
    # the same prompt and steps for both (each subject draws its prompt from its generator)
    deferring = probe._Subject("tova", np.random.default_rng(1), through_cache=True)
    writing = probe._Subject("tova written", np.random.default_rng(1), through_cache=True)
    rng = np.random.default_rng(2)
    k, v, q = probe._draw(rng, 1), probe._draw(rng, 1), probe._draw(rng, 1, probe.HQ)
    outs = []
    for subject in (deferring, writing):
        subject.velox.update_and_fetch(k, v)
        outs.append(subject.layer.hot.deferred is not None)
        subject.velox.attend(q, probe.SCALE, None, None)
        subject.flush()
    assert outs == [True, False]
    a = deferring.call(k, v, q)
    b = writing.call(k, v, q)
    assert np.array_equal(np.array(a), np.array(b))
    mx.eval(a, b)


def test_table_names_every_cache(capsys) -> None:
    assert probe.main(["--cache", "--methods", "h2o", "--rounds", "1", "--calls", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split("  ")[0].strip() for line in lines[2:]]
    assert names == ["KVCache", "h2o", "h2o written"]
