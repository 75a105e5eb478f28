"""The decode fast path (velox_cache_core.fast_step) against the general path, bit for bit.

Two layers of the same policy take the same calls: one with the fast path, one with it off
(``fast_step.ENABLED = False``, the general engine path that the reference tests check). After
every call the attention outputs, the stored slots (keys, values, positions, dead slot), the
running fields, the counters and the undo log must be identical, and so must every trim back
into the steps the fast path took. Random shapes, budgets, sinks, GQA ratios, batch rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_cache_core import fast_step as FS
from velox_cache_core.attention import attend as attend_step
from velox_cache_core.declarations import running_fields
from velox_cache_core.decode import Evicting as Hot
from velox_cache_core.layer import Layer, Mode
from velox_cache_core.registry import POLICIES
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.undo import new_log

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "tova": ("tova", {}),
    "tova_adapted": ("tova", {"signal": "key", "scope": "head"}),
    "tova_query_head": ("tova", {"scope": "head"}),
    "h2o": ("h2o", {}),
    "h2o_key_layer": ("h2o", {"signal": "key", "scope": "layer"}),
    "morphkv": ("morphkv", {"window": 3}),
    "morphkv_w1": ("morphkv", {"window": 1}),
    "morphkv_head_max": ("morphkv", {"window": 4, "fusion": "max", "scope": "head"}),
    "streaming_llm": ("streaming_llm", {}),
    "snapkv": ("snapkv", {}),
    "snapkv_key": ("snapkv", {"signal": "key", "kernel": 3}),
}


# the shapes every property test here draws: policy case, batch rows, KV heads, GQA ratio
SHAPES = {
    "case": st.sampled_from(sorted(CASES)),
    "B": st.integers(1, 2),
    "H": st.integers(1, 3),
    "group": st.integers(1, 3),
}


@contextmanager
def fast(on: bool) -> Iterator[None]:
    before = FS.ENABLED
    FS.ENABLED = on
    try:
        yield
    finally:
        FS.ENABLED = before


def _equal(a: Any, b: Any, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    if isinstance(a, mx.array):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert np.array_equal(np.array(a), np.array(b)), what
        return
    if isinstance(a, KVSlots):
        a, b = a.compact(), b.compact()
        for name in ("keys", "values", "positions"):
            _equal(getattr(a, name), getattr(b, name), f"{what}.{name}")
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for name in a:
            _equal(a[name], b[name], f"{what}[{name}]")
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{what}[{i}]")
        return
    if hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            _equal(getattr(a, name), getattr(b, name), f"{what}.{name}")
        return
    assert a == b, what


def _same_layers(a: Layer, b: Layer) -> None:
    sa, sb = a.view(), b.view()
    for name in running_fields(type(sa)):
        if name == "slots" and sa.slots is not None:  # the dead slot too, not only the rows
            _equal(sa.slots.keys, sb.slots.keys, "slots.keys")
            _equal(sa.slots.values, sb.slots.values, "slots.values")
            _equal(sa.slots.positions, sb.slots.positions, "slots.positions")
            _equal(sa.slots.free, sb.slots.free, "slots.free")
        else:
            _equal(getattr(sa, name), getattr(sb, name), name)
    assert (a.log is None) == (b.log is None)
    if a.log is not None and b.log is not None:
        assert a.log.tokens == b.log.tokens
        assert len(a.log.entries) == len(b.log.entries)
        for ea, eb in zip(a.log.entries, b.log.entries, strict=True):
            _equal(ea, eb, "log entry")


def _layers(case: str, budget: int, n_sink: int, window: int, mode: Mode) -> tuple[Layer, Layer]:
    name, settings_ = CASES[case]
    policy = POLICIES[name]
    kwargs = dict(settings_, budget=budget, n_sink=n_sink)
    if name == "snapkv":  # no sinks; a window that fits the budget
        del kwargs["n_sink"]
        kwargs["window"] = max(1, budget // 2)
    if name == "morphkv":
        kwargs["window"] = min(kwargs["window"], budget - n_sink + 1)
    if name == "h2o":
        kwargs["recent"] = max(0, min(budget // 2, budget - n_sink - 1))
    state = policy.init(**kwargs)
    return (
        Layer(policy, state, new_log(window), mode=mode),
        Layer(policy, state, new_log(window), mode=mode),
    )


def _call(layer: Layer, keys: mx.array, values: mx.array, queries: mx.array | None) -> Any:
    laid = layer.lay_out(keys, values)
    if queries is None:
        layer.settle()
        return laid
    return layer.attend(queries, scale=0.3)


def _drawer(
    rng: np.random.Generator, B: int, H: int, group: int, D: int
) -> Callable[[int], tuple[mx.array, mx.array, mx.array]]:
    """``draw(L)``: random keys, values ``[B, H, L, D]`` and queries ``[B, H * group, L, D]``."""

    def draw(L: int) -> tuple[mx.array, mx.array, mx.array]:
        k = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32))
        q = mx.array(rng.standard_normal((B, H * group, L, D)).astype(np.float32))
        return k, v, q

    return draw


def _trim_both(fast_layer: Layer, slow_layer: Layer, n: int, most: int | None = None) -> None:
    """Trim ``n`` tokens from both layers when ``0 < n``, the logs reach back that far and
    ``n <= most`` (``None``: no other bound), and compare them after."""
    log = fast_layer.log
    if n and log is not None and n <= log.tokens and (most is None or n <= most):
        fast_layer.trim(n)
        slow_layer.trim(n)
        _same_layers(fast_layer, slow_layer)


def _drive(
    case: str,
    *,
    B: int,
    H: int,
    group: int,
    D: int,
    budget: int,
    n_sink: int,
    prompt: int,
    steps: int,
    trims: list[int],
    seed: int,
    mode: Mode = Mode.QUERIES,
) -> int:
    """Feed both layers a prompt and ``steps`` decode tokens (trimming ``trims[i]`` after step
    ``i`` when given); compare after every call. Returns how many steps took the fast path."""
    fast_layer, slow_layer = _layers(case, budget, n_sink, 4, mode)
    rng = np.random.default_rng(seed)

    draw = _drawer(rng, B, H, group, D)
    use_queries = mode is not Mode.AT_ONCE
    k, v, q = draw(prompt)
    for layer, on in ((fast_layer, True), (slow_layer, False)):
        with fast(on):
            _call(layer, k, v, q if use_queries else None)
    taken = 0
    for i in range(steps):
        k, v, q = draw(1)
        with fast(True):
            policy, state = fast_layer.policy, fast_layer.state
            appends = FS.appends(policy, state)
            taken += int(appends or FS.eligible(policy, state, queries_needed=True) is not None)
            out_fast = _call(fast_layer, k, v, q if use_queries else None)
        with fast(False):
            out_slow = _call(slow_layer, k, v, q if use_queries else None)
        if use_queries:
            _equal(out_fast, out_slow, f"attention output, step {i}")
        _same_layers(fast_layer, slow_layer)
        _trim_both(fast_layer, slow_layer, trims[i] if i < len(trims) else 0)
    return taken


@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_path_matches_general_path(case: str) -> None:
    taken = _drive(
        case, B=1, H=2, group=3, D=8, budget=8, n_sink=2, prompt=11, steps=24,
        trims=[0] * 10 + [3, 0, 0, 1, 0, 0, 4], seed=1,
    )  # fmt: skip
    assert taken >= 15, f"{case}: only {taken} of 24 decode steps took the fast path"


@pytest.mark.parametrize("case", ["tova_adapted", "h2o_key_layer", "streaming_llm"])
def test_fast_path_decides_at_once_without_queries(case: str) -> None:
    _drive(
        case, B=2, H=3, group=1, D=4, budget=6, n_sink=1, prompt=9, steps=12,
        trims=[0, 0, 0, 2, 0, 0, 0, 3], seed=2, mode=Mode.AT_ONCE,
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    **SHAPES,
    budget=st.integers(4, 12),
    n_sink=st.integers(0, 3),
    prompt=st.integers(1, 20),
    steps=st.integers(1, 20),
    trims=st.lists(st.integers(0, 4), max_size=20),
    seed=st.integers(0, 2**16),
)
def test_fast_path_property(
    case: str,
    B: int,
    H: int,
    group: int,
    budget: int,
    n_sink: int,
    prompt: int,
    steps: int,
    trims: list[int],
    seed: int,
) -> None:
    n_sink = min(n_sink, budget - 2)
    _drive(
        case, B=B, H=H, group=group, D=4, budget=budget, n_sink=n_sink, prompt=prompt,
        steps=steps, trims=trims, seed=seed,
    )  # fmt: skip


def test_off_switch_and_ineligible_states_take_the_general_path() -> None:
    policy = POLICIES["expected_attention"]
    state = policy.init(budget=8)
    assert FS.eligible(policy, state, queries_needed=True) is None  # not opted in
    tova = POLICIES["tova"]
    assert FS.eligible(tova, tova.init(budget=8), queries_needed=True) is None  # no slots yet
    layer = Layer(tova, tova.init(budget=4, n_sink=1), new_log(4))
    k = mx.ones((1, 1, 6, 4))
    layer.lay_out(k, k)
    layer.attend(mx.ones((1, 1, 6, 4)), 0.5)
    with fast(False):
        layer.lay_out(k[:, :, :1], k[:, :, :1])
        assert layer.hot is None
        layer.attend(mx.ones((1, 1, 1, 4)), 0.5)
    with fast(True):
        layer.lay_out(k[:, :, :1], k[:, :, :1])
        layer.attend(mx.ones((1, 1, 1, 4)), 0.5)
        assert layer.hot is not None and layer.hot.steady


def test_streaming_llm_reads_the_row_it_overwrites_one_step_ahead() -> None:
    """With an undo log, StreamingLLM's step frees the oldest row before writing over it; the
    fast path reads that row in the step before (so the write is not in the graph that reads
    the old store, and MLX writes in place) and the undo entry holds exactly that row."""
    policy = POLICIES["streaming_llm"]
    layer = Layer(policy, policy.init(budget=5, n_sink=1), new_log(4))
    rng = np.random.default_rng(0)
    k = mx.array(rng.normal(size=(1, 2, 7, 4)).astype(np.float32))
    layer.lay_out(k, k)
    layer.attend(mx.ones((1, 2, 7, 4)), 0.5)
    rows = []
    for i in range(4):
        new = mx.array(rng.normal(size=(1, 2, 1, 4)).astype(np.float32))
        hot = layer.hot
        before = layer.state.slots.keys if hot is None else hot.keys  # reading state cools it
        prefetched = hot is not None and hot.ahead is not None
        layer.lay_out(new, new)
        layer.attend(mx.ones((1, 2, 1, 4)), 0.5)
        rows.append(prefetched)
        if i % 2:  # every other step, read the log (its last entry's row) and the store
            entry = layer.log.entries[-1]
            assert entry.row is not None
            slot = np.array(entry.written)
            want = np.take_along_axis(np.array(before), slot[:, :, None, None], axis=2)
            assert np.array_equal(np.array(entry.row.keys), want)
    assert rows == [False, True, False, True]  # the step after a read computes it again
    without = Layer(policy, policy.init(budget=5, n_sink=1), None)
    without.lay_out(k, k)
    without.attend(mx.ones((1, 2, 7, 4)), 0.5)
    without.lay_out(k[:, :, :1], k[:, :, :1])
    without.attend(mx.ones((1, 2, 1, 4)), 0.5)
    assert without.hot is not None and without.hot.ahead is None  # nothing to keep


def test_bad_queries_on_the_fast_path_change_nothing() -> None:
    tova = POLICIES["tova"]
    layer = Layer(tova, tova.init(budget=4, n_sink=1), new_log(4))
    k = mx.ones((1, 2, 7, 4))
    layer.lay_out(k, k)
    layer.attend(mx.ones((1, 2, 7, 4)), 0.5)
    layer.lay_out(k[:, :, :1], k[:, :, :1])
    layer.attend(mx.ones((1, 2, 1, 4)), 0.5)
    before = layer.state
    layer.lay_out(k[:, :, :1], k[:, :, :1])
    hot = layer.hot
    assert hot is not None and hot.flight is not None
    kept = (hot.keys, hot.values, hot.positions, hot.free, hot.running, hot.offset)
    with pytest.raises(ValueError, match="multiple of keys H_kv"):
        layer.attend(mx.ones((1, 3, 1, 4)), 0.5)
    assert layer.hot is hot and hot.flight is not None  # the token is still in flight
    assert (hot.keys, hot.values, hot.positions, hot.free, hot.running, hot.offset) == kept
    layer.attend(mx.ones((1, 2, 1, 4)), 0.5)  # the call is still there to settle
    assert layer.state.offset == before.offset + 1


def _as_fast_took(
    fast_layer: Layer, slow_layer: Layer, k: mx.array, v: mx.array, q: mx.array
) -> mx.array:
    """The call the fast layer just took, on the general layer: token by token (each token as
    its own array, as a decode step gets it) when the fast one ran it as decode steps, else
    whole (the general path took the chunk on both); its attention output."""
    with fast(False):
        if not fast_layer.stepped:
            return _call(slow_layer, k, v, q)
        L = int(k.shape[2])
        one = [[mx.contiguous(x[:, :, j : j + 1]) for x in (k, v, q)] for j in range(L)]
        return mx.concatenate([_call(slow_layer, *token) for token in one], axis=2)


def _drive_chunks(
    case: str, *, B: int, H: int, group: int, budget: int, chunks: list[int], trims: list[int],
    seed: int,
) -> int:  # fmt: skip
    """Short chunks (speculative verify chunks) on the fast layer, the same tokens one by one
    on the general one: identical outputs, stores, running fields and undo logs, and trims
    after each chunk. Returns how many chunks ran as decode steps."""
    fast_layer, slow_layer = _layers(case, budget, 1, 8, Mode.QUERIES)
    rng = np.random.default_rng(seed)
    D = 4

    draw = _drawer(rng, B, H, group, D)
    k, v, q = draw(budget + 3)
    for layer, on in ((fast_layer, True), (slow_layer, False)):
        with fast(on):
            _call(layer, k, v, q)
    stepped = 0
    for i, L in enumerate(chunks):
        k, v, q = draw(L)
        with fast(True):
            out_fast = _call(fast_layer, k, v, q)
            stepped += int(bool(fast_layer.stepped))
            if fast_layer.stepped:  # one undo entry per token: a trim only pops entries
                entries = fast_layer.log.entries if fast_layer.log is not None else ()
                assert all(e.length == 1 and e.inputs is None for e in entries[-L:])
        _equal(
            out_fast, _as_fast_took(fast_layer, slow_layer, k, v, q), f"attention output, chunk {i}"
        )
        _same_layers(fast_layer, slow_layer)
        _trim_both(fast_layer, slow_layer, trims[i] if i < len(trims) else 0, L)
    return stepped


@pytest.mark.parametrize("case", sorted(CASES))
def test_short_chunks_run_as_decode_steps(case: str) -> None:
    stepped = _drive_chunks(
        case, B=1, H=2, group=2, budget=8, chunks=[4, 4, 2, 5, 4, 3, 4, 16],
        trims=[3, 0, 1, 4, 2, 3, 0, 9], seed=3,
    )  # fmt: skip
    opted_in = POLICIES[CASES[case][0]].compiled_decode and case != "snapkv"
    # the first chunk after the prompt may find the store not yet steady (no dead slot)
    assert stepped >= 7 if opted_in else stepped == 0, f"{case}: {stepped} of 8 chunks stepped"


@pytest.mark.parametrize("case", ["tova", "h2o", "morphkv", "streaming_llm"])
def test_a_chunk_whose_trace_leaves_the_steady_state_runs_its_steps_one_by_one(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk's one-call trace gives up when it finds a step leaving the steady state
    (here: every trace says so), marks the chunk key, and the layer runs the chunk's steps one
    by one, with the same results."""
    monkeypatch.setattr(FS, "_KERNELS", {})  # no chunk kernel traced by an earlier test

    def leaves(*args: Any) -> Any:
        def kernel(*inputs: Any) -> Any:
            raise FS.NotSteady

        return kernel

    monkeypatch.setattr(FS, "steps_kernel", leaves)
    calls: list[bool] = []
    run_steps = Hot._run_steps

    def counted(self: Hot, *args: Any) -> Any:
        out = run_steps(self, *args)
        calls.append(out is None)
        return out

    monkeypatch.setattr(Hot, "_run_steps", counted)
    stepped = _drive_chunks(
        case, B=1, H=2, group=2, budget=8, chunks=[4, 4, 3, 5], trims=[3, 0, 2, 1], seed=5
    )
    assert stepped >= 3 and calls and all(calls)  # every chunk fell back, and still stepped
    flags = [flag for k in FS._KERNELS.values() for _, flag in k.decide.values()]
    assert [False] in flags


@settings(max_examples=20, deadline=None)
@given(
    **SHAPES,
    budget=st.integers(4, 10),
    chunks=st.lists(st.integers(2, 7), min_size=1, max_size=8),
    trims=st.lists(st.integers(0, 6), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_short_chunks_property(
    case: str, B: int, H: int, group: int, budget: int, chunks: list[int], trims: list[int],
    seed: int,
) -> None:  # fmt: skip
    _drive_chunks(case, B=B, H=H, group=group, budget=budget, chunks=chunks, trims=trims, seed=seed)


def test_a_stepped_chunk_the_queries_never_reach_is_settled_by_the_general_path() -> None:
    tova = POLICIES["tova"]
    a = Layer(tova, tova.init(budget=4, n_sink=1, signal="query"), new_log(8))
    b = Layer(tova, tova.init(budget=4, n_sink=1, signal="query"), new_log(8))
    k = mx.array(np.random.default_rng(4).standard_normal((1, 1, 10, 4)).astype(np.float32))
    for layer in (a, b):
        layer.lay_out(k[:, :, :6], k[:, :, :6])
        layer.attend(k[:, :, :6], 0.5)
        layer.lay_out(k[:, :, 6:7], k[:, :, 6:7])  # a decode step: the store is steady
        layer.attend(k[:, :, 6:7], 0.5)
    a.lay_out(k[:, :, 7:], k[:, :, 7:])
    assert a.hot is not None and a.hot.chunk is not None  # waiting to run as decode steps
    with fast(False):
        b.lay_out(k[:, :, 7:], k[:, :, 7:])
    with warnings.catch_warnings():  # the no-hook fallback warns once per process
        warnings.simplefilter("ignore", RuntimeWarning)
        a.settle()
        with fast(False):
            b.settle()
    _same_layers(a, b)


@pytest.mark.parametrize("case", ["tova", "streaming_llm", "h2o_key_layer"])
def test_a_layer_sharing_a_stepped_chunk_attends_each_row_over_its_step(case: str) -> None:
    # KV sharing (gemma3n): another layer's queries attend over this call's keys and values
    layer, _ = _layers(case, 4, 1, 8, Mode.QUERIES)
    rng = np.random.default_rng(5)
    k = mx.array(rng.standard_normal((1, 1, 10, 4)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 2, 10, 4)).astype(np.float32))
    for part in (slice(0, 6), slice(6, 7)):  # a prompt and a decode step: the store is steady
        layer.lay_out(k[:, :, part], k[:, :, part])
        layer.attend(q[:, :, part], 0.5)
    layer.lay_out(k[:, :, 7:], k[:, :, 7:])
    first = layer.attend(q[:, :, 7:], 0.5)
    assert [(a, b) for a, b, _ in layer.stepped] == [(0, 1), (1, 2), (2, 3)]
    again = layer.attend(q[:, :, 7:], 0.5)  # the sharing layer, with the same queries
    np.testing.assert_allclose(np.array(again), np.array(first), rtol=1e-6, atol=1e-6)
    other = mx.array(rng.standard_normal((1, 2, 3, 4)).astype(np.float32))
    shared = layer.attend(other, 0.5)
    for a, b, step in layer.stepped:  # each row over the candidates of its own step
        np.testing.assert_allclose(
            np.array(shared[:, :, a:b]),
            np.array(attend_step(other[:, :, a:b], replace(step, probs=None), 0.5, None)),
            rtol=1e-6,
        )


def test_arrays_reads_the_decode_path_store_without_leaving_it() -> None:
    """``Layer.arrays()`` evaluates the rows as the decode path holds them; reading the state
    afterwards gives the same rows (the store cooled into the frozen state)."""
    tova = POLICIES["tova"]
    layer = Layer(tova, tova.init(budget=4, n_sink=1), new_log(4))
    rng = np.random.default_rng(7)
    k = mx.array(rng.standard_normal((1, 2, 9, 4)).astype(np.float32))
    layer.lay_out(k[:, :, :6], k[:, :, :6])
    layer.attend(mx.ones((1, 2, 6, 4)), 0.5)
    for i in range(6, 9):
        layer.lay_out(k[:, :, i : i + 1], k[:, :, i : i + 1])
        layer.attend(mx.ones((1, 2, 1, 4)), 0.5)
    hot = layer.hot
    assert hot is not None
    held = layer.arrays()
    mx.eval(held)
    assert layer.hot is hot  # still decoding
    slots = layer.state.slots  # leaves the decode path
    assert layer.hot is None
    pairs = zip(held, slots.arrays(), strict=True)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in pairs)


def _drive_hot_trims(
    case: str, *, B: int, H: int, group: int, budget: int, calls: list[tuple[int, int]],
    seed: int, window: int = 8,
) -> int:  # fmt: skip
    """``calls``: (tokens, trim after) pairs, a decode step (1) or a short chunk, as a
    speculative round makes them. The fast layer is never read between calls (its state, log
    and pending are not touched, so it stays on the decode path and trims there); the general
    one takes the same tokens one by one and the same trims. Outputs equal at every call, the
    layers equal at the end (and their trims back into the log). Returns how many trims the
    decode path took in place."""
    fast_layer, slow_layer = _layers(case, budget, 1, window, Mode.QUERIES)
    draw = _drawer(np.random.default_rng(seed), B, H, group, 4)
    k, v, q = draw(budget + 3)
    for layer, on in ((fast_layer, True), (slow_layer, False)):
        with fast(on):
            _call(layer, k, v, q)
    in_place = 0
    for i, (L, n) in enumerate(calls):
        k, v, q = draw(L)
        with fast(True):
            out_fast = _call(fast_layer, k, v, q)
        _equal(
            out_fast, _as_fast_took(fast_layer, slow_layer, k, v, q), f"attention output, call {i}"
        )
        log = slow_layer.log
        if n and log is not None and n <= log.tokens:
            hot = fast_layer.hot
            with fast(True):
                fast_layer.trim(n)
            in_place += int(hot is not None and fast_layer.hot is hot)
            with fast(False):
                slow_layer.trim(n)
            assert fast_layer.offset == slow_layer.offset
    _same_layers(fast_layer, slow_layer)
    for n in (1, 2):  # and the logs left reach back alike
        _trim_both(fast_layer, slow_layer, n)
    return in_place


@pytest.mark.parametrize("case", sorted(CASES))
def test_trims_on_the_decode_path_equal_the_general_path(case: str) -> None:
    """A speculative pattern: verify chunks, each followed by a trim, and decode steps."""
    calls = [(1, 0), (1, 0), (4, 2), (5, 4), (1, 1), (3, 0), (5, 3), (1, 0), (1, 0), (2, 1)]
    in_place = _drive_hot_trims(case, B=1, H=2, group=2, budget=8, calls=calls, seed=7)
    opted_in = POLICIES[CASES[case][0]].compiled_decode and case != "snapkv"
    if opted_in and case not in ("morphkv", "morphkv_head_max"):  # histories: general trim
        assert in_place >= 4, f"{case}: {in_place} trims in place"
    elif case.startswith("snapkv"):  # chunks take the general path; a decode step's trim not
        assert in_place >= 1, f"{case}: {in_place} trims in place"


@settings(max_examples=25, deadline=None)
@given(
    **SHAPES,
    budget=st.integers(4, 10),
    calls=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=10),
    window=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_trims_on_the_decode_path_property(
    case: str, B: int, H: int, group: int, budget: int, calls: list[tuple[int, int]],
    window: int, seed: int,
) -> None:  # fmt: skip
    _drive_hot_trims(
        case, B=B, H=H, group=group, budget=budget, calls=calls, seed=seed, window=window
    )
