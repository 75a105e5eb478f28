"""Exact trims over lanes: TOVA, H2O and Expected Attention with per-head shares (evicting at
every step over lanes) take back their last tokens exactly, as if they had never been fed:
the lanes' live rows, positions, dead rows and running scores, and what the next token
attends to, equal those of a cache that never saw them (bit for bit; a dead row's content is
moot, and after a trim back to the oldest logged token it may differ)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core.attention import attend
from velox_cache_core.undo import UndoLog

B, H, G, D = 1, 2, 2, 8
SCALE = D**-0.5
CASES: dict[str, dict[str, Any]] = {
    "tova": {"budget": 16, "n_sink": 2, "scope": "head", "allocation": "head"},
    "h2o": {"budget": 16, "n_sink": 2, "recent": 2, "scope": "head", "allocation": "head"},
    "expected_attention": {
        "budget": 16,
        "n_sink": 2,
        "recent": 2,
        "refresh_every": 3,
        "n_queries": 6,
        "rope_base": 1e4,
        "allocation": "head",
    },
}
PROMPT = 48


def _stream(seed: int, n: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    scale = np.array([0.5, 2.0])[:H].reshape(1, H, 1, 1)  # heads with different shares
    k = rng.standard_normal((B, H, n, D)) * scale
    v = rng.standard_normal((B, H, n, D))
    q = rng.standard_normal((B, H * G, n, D)) * 1.5
    return tuple(mx.array(a.astype(np.float32)) for a in (k, v, q))  # type: ignore[return-value]


def _run(name: str, stream: Any, chunks: list[int], log: UndoLog | None) -> tuple[Any, Any]:
    """Prompt, its cut (the prompt end, then the first single token), then ``chunks``."""
    policy = POLICIES[name]
    k, v, q = stream
    state = policy.init(**CASES[name])
    step = policy.update(state, k[:, :, :PROMPT], v[:, :, :PROMPT], q[:, :, :PROMPT], log=log)
    state = policy.end_prompt(step.state)
    log = None if log is None else step.log.cleared()  # a prompt end clears it (Layer does)
    start = PROMPT
    for size in [1, *chunks]:
        part = slice(start, start + size)
        step = policy.update(state, k[:, :, part], v[:, :, part], q[:, :, part], log=log)
        state, log = step.state, step.log
        start += size
    assert state.lanes is not None and state.lanes.free is not None
    return state, log


def _live(lanes: Any) -> list[mx.array]:
    """The lanes' arrays with each head's dead row zeroed (a dead row's content is moot: the
    next token overwrites it)."""
    Bn, N, W = lanes.positions.shape
    flat = mx.arange(N * W, dtype=mx.int32).reshape(1, 1, N * W)
    dead = (flat == lanes.free[:, :, None]).any(axis=1).reshape(Bn, N, W)
    out = [mx.where(dead, 0, lanes.positions), lanes.owner, lanes.free]
    out += [mx.where(dead[..., None], 0, a) for a in (lanes.keys, lanes.values)]
    return out + ([] if lanes.scores is None else [mx.where(dead, 0, lanes.scores)])


def _same(a: Any, b: Any) -> None:
    la, lb = _live(a.lanes), _live(b.lanes)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert mx.array_equal(x, y)
    assert a.offset == b.offset and a.tokens_seen == b.tokens_seen


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(CASES)),
    seed=st.integers(0, 1000),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    data=st.data(),
)
def test_a_trim_over_lanes_is_exact(name: str, seed: int, chunks: list[int], data: Any) -> None:
    fed = sum(chunks)
    n = data.draw(st.integers(0, fed), label="n")
    stream = _stream(seed, PROMPT + 1 + fed + 1)
    policy = POLICIES[name]
    state, log = _run(name, stream, chunks, UndoLog(16))
    trimmed, _ = policy.trim(state, log, n)
    # the cache that never saw the last n tokens: the same calls, the last ones cut short
    kept, left = [], fed - n
    for size in chunks:
        if left > 0:
            kept.append(min(size, left))
        left -= size
    want, _ = _run(name, stream, kept, None)
    _same(trimmed, want)
    # the next token attends to the same rows, with the same result
    k, v, q = stream
    t = PROMPT + 1 + fed - n
    nxt = [
        policy.update(s, k[:, :, t : t + 1], v[:, :, t : t + 1], q[:, :, t : t + 1])
        for s in (trimmed, want)
    ]
    outs = [np.array(attend(q[:, :, t : t + 1], step, SCALE)) for step in nxt]
    np.testing.assert_array_equal(outs[0], outs[1])
    _same(nxt[0].state, nxt[1].state)


def test_the_cut_itself_cannot_be_trimmed() -> None:
    stream = _stream(0, PROMPT + 4)
    policy = POLICIES["tova"]
    state, log = _run("tova", stream, [], UndoLog(8))
    assert log.tokens == 0  # the call that cut the prompt into shares cleared it
    with pytest.raises(ValueError, match="undo log holds the last 0"):
        policy.trim(state, log, 1)
