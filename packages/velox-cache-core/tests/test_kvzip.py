"""KVzip (velox_cache_core.policies.kvzip): the reconstruction scoring against a plain numpy
reference, the "latest" probe against TOVA's oneshot cut, the budget, and what decoding does
after the cut. The contract matrix (test_policy_contract.py) covers the rest with probe
"latest"."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from core_reference_lanes import reference_lanes_keep

from velox_cache_core import POLICIES
from velox_cache_core.allocation import shares as AS
from velox_cache_core.attention import attend
from velox_cache_core.policies.kvzip import (
    KVZIP,
    PAD,
    global_totals,
    kvzip_compress,
    kvzip_end_prompt,
    reconstruction_scores,
)
from velox_cache_core.policies.tova import TOVA, init_tova_state

B, H_KV, GROUP, D = 2, 2, 3, 8


def stream(n: int, seed: int = 0, scale: float = 1.5) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((B, H_KV, n, D)) * scale).astype(np.float32)
    values = rng.standard_normal((B, H_KV, n, D)).astype(np.float32)
    queries = (rng.standard_normal((B, H_KV * GROUP, n, D)) * scale).astype(np.float32)
    return keys, values, queries


def feed(state, keys, values, queries, chunks: list[int]):
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        args = (mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        state = KVZIP.update(state, *args, mx.array(queries[:, :, part])).state
        start += size
    return state


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_scores(
    ctx_keys: np.ndarray,
    chunks: list[tuple[int, int, np.ndarray, np.ndarray]],
    n_sink: int,
    scale: float,
) -> np.ndarray:
    """Loops over rows, KV heads, query heads and queries: for the chunk repeating context rows
    start..end-1, each query's softmax runs over the sinks before ``start``, those rows and
    the chunk's own keys up to itself; a row scores its largest weight. [B, H_kv, n]."""
    n = ctx_keys.shape[2]
    out = np.full((B, H_KV, n), np.nan)
    for start, end, queries, keys in chunks:
        sink = min(n_sink, start)
        for b in range(B):
            for h in range(H_KV):
                rows = [*range(sink), *range(start, end)]
                for qh in range(h * GROUP, (h + 1) * GROUP):
                    for i in range(queries.shape[2]):
                        q = queries[b, qh, i].astype(np.float64)
                        visible = [ctx_keys[b, h, p] for p in rows] + [
                            keys[b, h, j] for j in range(i + 1)
                        ]
                        weights = softmax(np.array([q @ k * scale for k in visible]))
                        for slot, p in enumerate(rows[sink:], start=sink):
                            prev = out[b, h, p]
                            out[b, h, p] = (
                                weights[slot] if np.isnan(prev) else max(prev, weights[slot])
                            )
    return out


def reference_keep(
    scores: np.ndarray, budget: int, n_sink: int, allocation: str = "uniform", total: int = -1
) -> list[list[list[int]]]:
    """Kept positions per (b, KV head) of a context of ``n`` rows at positions ``0..n-1``.
    ``uniform``: the sinks and the ``budget - n_sink`` best rows of each head (ties: the newer
    wins). ``head``/``global``: the shares of the plain lanes reference (a floor per head, the
    rest of ``total`` by score across heads, whole lanes), each head's best rows."""
    n = scores.shape[2]
    sink = min(n_sink, n)
    if allocation == "uniform":
        out = []
        for b in range(B):
            row = []
            for h in range(H_KV):
                rest = sorted(range(n_sink, n), key=lambda p: (-scores[b, h, p], -p))
                row.append(sorted([*range(sink), *rest[: budget - n_sink]]))
            out.append(row)
        return out
    positions = np.broadcast_to(np.arange(n), scores.shape)
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, AS.FLOOR, sink, width)
    want = budget * H_KV if total < 0 else total
    return reference_lanes_keep(scores, positions, positions < n_sink, want, least, width)


def real_rows(state) -> list[list[list[int]]]:
    """Kept positions per (b, KV head), pad slots left out."""
    return [
        [sorted(p for p in h if p != PAD) for h in b] for b in np.array(state.positions).tolist()
    ]


@pytest.mark.parametrize("allocation", ["uniform", "head"])
@pytest.mark.parametrize("n_sink", [0, 2, 5])
@pytest.mark.parametrize("sizes", [[17], [6, 6, 5], [4, 9, 4]])
def test_reconstruction_scores_and_cut_match_numpy(
    n_sink: int, sizes: list[int], allocation: str
) -> None:
    n, budget, scale = sum(sizes), 9, 0.4
    keys, values, queries = stream(n, seed=1)
    init = KVZIP.init(budget=budget, n_sink=n_sink, allocation=allocation)
    state = feed(init, keys, values, queries, [7, 1, n - 8])
    rng = np.random.default_rng(2)
    chunks, got, start = [], [], 0
    for size in sizes:
        R = size + 3  # an instruction of 3 tokens, then the repeated rows
        rq = (rng.standard_normal((B, H_KV * GROUP, R, D)) * 1.5).astype(np.float32)
        rk = (rng.standard_normal((B, H_KV, R, D)) * 1.5).astype(np.float32)
        chunks.append((start, start + size, rq, rk))
        got.append(
            reconstruction_scores(state, mx.array(rq), mx.array(rk), start, start + size, scale)
        )
        start += size
    scores = mx.concatenate(got, axis=-1)
    want = reference_scores(keys, chunks, n_sink, scale)
    np.testing.assert_allclose(np.array(scores), want, rtol=1e-5, atol=1e-7)
    cut = kvzip_compress(state, scores)
    assert cut.compressed and cut.offset == n
    kept = real_rows(cut)
    assert kept == reference_keep(want, budget, n_sink, allocation)
    if allocation == "uniform":
        assert cut.n_kept == budget and cut.lanes is None
    else:  # at most budget rows per head on average, held as lanes: nothing padded
        assert all(sum(map(len, row)) <= budget * H_KV for row in kept)
        assert cut.lanes is not None and cut.n_kept == 0
        rows = cut.lanes.n_lanes * cut.lanes.width
        assert cut.nbytes == B * rows * 2 * D * 4 == B * sum(map(len, kept[0])) * 2 * D * 4
    # The kept rows are the context's own keys and values at their true positions; the
    # per-head view pads with zeros.
    positions = np.array(cut.positions)
    for b in range(B):
        for h in range(H_KV):
            real = positions[b, h] != PAD
            got_k, got_v = np.array(cut.keys)[b, h], np.array(cut.values)[b, h]
            np.testing.assert_array_equal(got_k[real], keys[b, h, positions[b, h][real]])
            np.testing.assert_array_equal(got_v[real], values[b, h, positions[b, h][real]])
            assert not got_k[~real].any() and not got_v[~real].any()


def reference_attention(
    kept: list[list[list[int]]], keys, values, queries, start: int, size: int, scale: float
) -> np.ndarray:
    """Loops: query ``start + i`` of each head attends over its KV head's kept context rows
    and the new tokens up to itself. ``[B, H_q, size, D]``."""
    out = np.zeros((B, H_KV * GROUP, size, D))
    for b in range(B):
        for qh in range(H_KV * GROUP):
            h = qh // GROUP
            for i in range(size):
                seen = [*kept[b][h], *range(start, start + i + 1)]
                logits = np.array([queries[b, qh, start + i] @ keys[b, h, p] for p in seen])
                w = softmax(logits.astype(np.float64) * scale)
                out[b, qh, i] = w @ values[b, h, seen]
    return out


@pytest.mark.parametrize("allocation", ["head", "global"])
def test_shared_out_rows_are_attended_exactly(allocation: str) -> None:
    """Skewed scores give one head most of the rows (the other keeps its floor), and the
    queries after the cut (a chunk, then single tokens) attend exactly over the kept rows."""
    n, budget, scale = 24, 6, D**-0.5
    keys, values, queries = stream(n + 8, seed=7)
    state = feed(
        KVZIP.init(budget=budget, n_sink=2, allocation=allocation), keys, values, queries, [n]
    )
    scores = np.random.default_rng(3).random((B, H_KV, n)).astype(np.float32)
    scores[:, 0] += 1.0  # head 0 outscores head 1 everywhere
    cut = kvzip_compress(state, mx.array(scores))
    kept = real_rows(cut)
    assert kept == reference_keep(scores, budget, 2, "head")
    # head 1 keeps its floor (its 2 sinks, a whole lane of 2 rows); head 0 the rest
    assert [len(h) for h in kept[0]] == [2 * budget - 2, 2]
    assert cut.lanes is not None and cut.tokens_kept == budget
    assert cut.compression_ratio == n / budget
    start = n
    for size in (5, 1, 1, 1):
        part = slice(start, start + size)
        q = mx.array(queries[:, :, part])
        step = KVZIP.update(cut, mx.array(keys[:, :, part]), mx.array(values[:, :, part]), q)
        got = np.array(attend(q, step, scale))
        want = reference_attention(kept, keys, values, queries, start, size, scale)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        cut, start = step.state, start + size
        kept = [[[*h, *range(start - size, start)] for h in row] for row in kept]


def test_global_totals_match_numpy() -> None:
    """Every head's floor, then one threshold over the other scores of every head of every
    layer; each layer's total rounded to whole lanes, the rounding's spare lanes handed back."""
    rng = np.random.default_rng(11)
    layers = [rng.random((1, 3, 40)).astype(np.float32) * (i + 1) for i in range(4)]
    budget, n_sink = 16, 2
    state = KVZIP.init(budget=budget, n_sink=n_sink)
    totals = global_totals([mx.array(x) for x in layers], state)
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, AS.FLOOR, n_sink, width)
    pool = []
    for i, x in enumerate(layers):
        for h in range(3):
            order = sorted(range(40), key=lambda p, h=h: (p >= n_sink, -x[0, h, p], -p))
            pool += [(x[0, h, p], i) for p in order[least:]]
    pool.sort(key=lambda t: -t[0])
    won = [0] * 4
    for _, i in pool[: budget * 3 * 4 - least * 3 * 4]:
        won[i] += 1
    raw = [least * 3 + w for w in won]
    want = [width * (r // width) for r in raw]
    spare = sum(raw) - sum(want)  # freed lanes go back, largest remainder first
    for i in sorted(range(4), key=lambda i: (-(raw[i] % width), i))[: spare // width]:
        want[i] += width
    assert totals == want and sum(totals) == budget * 3 * 4
    assert totals[-1] > totals[0]  # the layer with the larger scores keeps more
    with pytest.raises(ValueError, match="one sequence"):
        global_totals([mx.zeros((2, 3, 20))], state)


@pytest.mark.parametrize("signal", ["query", "key"])
@pytest.mark.parametrize(("n", "budget", "n_sink"), [(30, 10, 2), (30, 29, 0), (8, 10, 1)])
def test_latest_probe_is_tova_oneshot_bit_for_bit(
    signal: str, n: int, budget: int, n_sink: int
) -> None:
    keys, values, queries = stream(n, seed=3)
    k, v, q = mx.array(keys), mx.array(values), mx.array(queries)
    tova = init_tova_state(
        budget=budget, n_sink=n_sink, signal=signal, scope="head", prefill="oneshot"
    )
    tova = TOVA.update(tova, k, v, q).state
    fed = KVZIP.update(
        KVZIP.init(budget=budget, n_sink=n_sink, probe="latest", signal=signal), k, v, q
    ).state
    zipped = KVZIP.end_prompt(fed)
    assert zipped.compressed and zipped.offset == tova.offset == n
    for name in ("positions", "keys", "values"):
        assert mx.array_equal(getattr(zipped.slots, name), getattr(tova.slots, name)), name
    # Fed in several chunks, the cut is the same (only the last context row decides).
    chunked = feed(
        KVZIP.init(budget=budget, n_sink=n_sink, probe="latest", signal=signal),
        keys,
        values,
        queries,
        [3, 1, n - 4],
    )
    assert mx.array_equal(kvzip_end_prompt(chunked).positions, zipped.positions)


@pytest.mark.parametrize("allocation", ["uniform", "head", "global"])
def test_budget_is_never_exceeded_and_decode_after_the_cut(allocation: str) -> None:
    keys, values, queries = stream(40, seed=4)
    for budget in (3, 7, 12):
        init = KVZIP.init(budget=budget, n_sink=2, allocation=allocation)
        state = feed(init, keys, values, queries, [25])
        assert state.n_kept == 25 and not state.compressed
        assert kvzip_end_prompt(state) is state  # the reconstruction probe waits for scores
        scores = mx.array(np.random.default_rng(budget).random((B, H_KV, 25)).astype(np.float32))
        cut = kvzip_compress(state, scores)
        kept = real_rows(cut)
        if allocation == "uniform":
            assert cut.n_kept == budget
            assert all(sum(map(len, row)) == budget * H_KV for row in kept)
        # at most budget per head on average (exactly, per head, uniform); every head its sinks
        assert all(sum(map(len, row)) <= budget * H_KV for row in kept)
        assert all(h[:2] == [0, 1] for row in kept for h in row)
        uniform = replace(init, allocation="uniform")
        assert (
            cut.nbytes <= kvzip_compress(feed(uniform, keys, values, queries, [25]), scores).nbytes
        )
        assert kvzip_compress(cut, scores) is cut
        # after="append": questions and answers grow the cache.
        grown = feed(cut, keys[:, :, 25:], values[:, :, 25:], queries[:, :, 25:], [5, 1, 1])
        assert grown.slots.n_kept == cut.slots.n_kept + 7 and grown.offset == 32
        assert grown.tokens_kept == cut.tokens_kept + 7


def test_after_tova_continues_with_tovas_rule() -> None:
    keys, values, queries = stream(40, seed=5)
    init = KVZIP.init(budget=8, n_sink=1, after="tova")
    assert init.allocation == "uniform"  # after="tova" takes the cut it needs by default
    state = feed(init, keys, values, queries, [20])
    scores = mx.array(np.random.default_rng(0).random((B, H_KV, 20)).astype(np.float32))
    cut = kvzip_compress(state, scores)
    tova = replace(
        init_tova_state(budget=8, n_sink=1, scope="head"),
        slots=cut.slots,
        offset=cut.offset,
        tokens_seen=cut.tokens_seen,
    )
    start = 20
    for size in (6, 1, 1, 3, 1):
        part = slice(start, start + size)
        args = (mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        a = KVZIP.update(cut, *args, mx.array(queries[:, :, part]))
        b = TOVA.update(tova, *args, mx.array(queries[:, :, part]))
        assert a.state.n_kept <= 8
        assert mx.array_equal(a.state.slots.positions, b.state.slots.positions)
        if size > 1:
            assert mx.array_equal(a.mask, b.mask)
        cut, tova = a.state, b.state
        start += size


def test_bad_arguments() -> None:
    keys, values, queries = stream(12, seed=6)
    state = feed(KVZIP.init(budget=4, n_sink=1), keys, values, queries, [12])
    with pytest.raises(ValueError, match="reconstruction scores"):
        kvzip_compress(state)
    with pytest.raises(ValueError, match="allocation='uniform'"):
        KVZIP.init(budget=8, after="tova", allocation="global")
    with pytest.raises(ValueError, match="allocation must be one of"):
        KVZIP.init(budget=8, allocation="heads")
    with pytest.raises(ValueError, match="total must be >= 0"):
        kvzip_compress(state, mx.zeros((B, H_KV, 12)), total=-1)
    with pytest.raises(ValueError, match="scores must be"):
        kvzip_compress(state, mx.zeros((B, H_KV, 11)))
    with pytest.raises(TypeError, match="KVzipState"):
        kvzip_compress(POLICIES["snapkv"].init())
    q, k = mx.array(queries[:, :, :3]), mx.array(keys[:, :, :3])
    with pytest.raises(ValueError, match="start < end"):
        reconstruction_scores(state, q, k, 5, 13)
    cut = kvzip_compress(state, mx.zeros((B, H_KV, 12)))
    with pytest.raises(ValueError, match="already compressed"):
        reconstruction_scores(cut, q, k, 0, 4)
