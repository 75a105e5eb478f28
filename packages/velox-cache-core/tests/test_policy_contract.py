"""One contract matrix over every policy in the registry (docs/architecture.md sections 3-5):
what stays true whatever the rule, and agreement with each policy's plain numpy reference. What is
special to one policy is tested in test_<policy>.py.

Adding a policy means adding one entry to ``CASES`` (below), keyed by its registry name:

    CASES["toy"] = Case(
        settings={"budget": 5, "n_sink": 1},   # small, valid: the fixed-stream tests use these
        reference=ReferenceToy,                # numpy reference, built as ReferenceToy(**settings)
                                               #   with the state's full settings
        strategy=st.fixed_dictionaries({"budget": st.integers(1, 10)}),
                                               # hypothesis: random valid settings (init fills in
                                               #   the defaults of the others)
        # Optional, with their defaults:
        axes={},              # {setting: values}: the fixed-stream reference test runs every
                              #   combination, on top of `settings`
        chunk_invariant={},   # settings overrides under which chunking changes nothing
                              #   ({"prefill": "sequential"}); the invariance test applies them
        prompt_end=None,      # state -> state: the engine's end-of-prompt step (SnapKV's
                              #   snapkv_compress); the reference's compress() runs at the same
                              #   point. A policy with one evicts only there: it grows before and
                              #   after it, and the reference tests also feed a few decode tokens
        check_step=None,      # (step, Call) -> None: extra checks after every engine call of the
                              #   reference tests (e.g. H2O's running scores)
        uses_queries=True,    # the registry's uses_queries (False: queries are optional)
        bad=[],               # [(settings overrides, parameter the message names)] init refuses,
                              #   on top of the budget / n_sink ones every policy gets
        ok=[],                # [settings] on the edge of validity that init accepts
    )

The reference is an object with ``feed(keys, values, queries, scale) -> (outputs, positions)``,
``positions()``, ``kept_rows(b, h)``, ``last_visible``, ``min_margin``, ``kept`` and ``offset``
(and ``compress()`` with a prompt_end), like those in core_reference.py and
core_reference_siblings.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest
from core_reference import ReferenceTova
from core_reference_expected_attention import ReferenceExpectedAttention
from core_reference_kvzip import ReferenceKVzip
from core_reference_siblings import (
    ReferenceH2O,
    ReferenceMorphKV,
    ReferenceSnapKV,
    ReferenceStreamingLLM,
)
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES, Policy, expected_attention_compress, snapkv_compress
from velox_cache_core.engine import GROW
from velox_cache_core.pins import pin
from velox_cache_core.policies.kvzip import kvzip_end_prompt
from velox_cache_core.store.token_rows import Quant

# ------------------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class Call:
    """What a `check_step` hook knows about the engine call it checks."""

    before: Any  # the call's input state
    length: int  # tokens in the call
    n_q: int  # query heads
    give_queries: bool  # whether the call got its queries
    ref: Any  # the reference, after its matching feed
    ended: bool  # whether prompt_end already ran


@dataclasses.dataclass(frozen=True)
class Case:
    """One policy's entry in the contract matrix (see the module docstring)."""

    settings: dict[str, Any]
    reference: Callable[..., Any]
    strategy: st.SearchStrategy[dict[str, Any]]
    axes: dict[str, tuple] = dataclasses.field(default_factory=dict)
    chunk_invariant: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_end: Callable[[Any], Any] | None = None
    check_step: Callable[[Any, Call], None] | None = None
    uses_queries: bool = True
    bad: list[tuple[dict[str, Any], str]] = dataclasses.field(default_factory=list)
    ok: list[dict[str, Any]] = dataclasses.field(default_factory=list)


SIGNALS, SCOPES, PREFILLS = ("query", "key"), ("layer", "head"), ("sequential", "oneshot")
# The rule's choices, every combination of which is valid (docs/architecture.md section 3).
ATTENTION_AXES = {"signal": SIGNALS, "scope": SCOPES, "prefill": PREFILLS}


def attention_settings(draw: st.DrawFn) -> dict[str, str]:
    return {name: draw(st.sampled_from(values)) for name, values in ATTENTION_AXES.items()}


@st.composite
def tova_settings(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(1, 12))
    return {
        "budget": budget,
        "n_sink": draw(st.integers(0, budget - 1)),
        **attention_settings(draw),
    }


@st.composite
def h2o_settings(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(1, 10))
    n_sink = draw(st.integers(0, budget - 1))
    recent = draw(st.integers(0, budget - n_sink))
    return {"budget": budget, "n_sink": n_sink, "recent": recent, **attention_settings(draw)}


@st.composite
def streaming_llm_settings(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(1, 10))
    return {"budget": budget, "n_sink": draw(st.integers(0, budget - 1))}


@st.composite
def snapkv_settings(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(2, 12))
    return {
        "budget": budget,
        "window": draw(st.integers(1, budget - 1)),
        "kernel": draw(st.sampled_from((1, 3, 5, 7))),
        "signal": draw(st.sampled_from(SIGNALS)),
    }


@st.composite
def morphkv_settings(draw: st.DrawFn) -> dict[str, Any]:
    budget = draw(st.integers(1, 10))
    n_sink = draw(st.integers(0, budget - 1))
    return {
        "budget": budget,
        "n_sink": n_sink,
        "window": draw(st.integers(1, budget - n_sink + 1)),
        "fusion": draw(st.sampled_from(("mean", "max"))),
        **attention_settings(draw),
    }


@st.composite
def kvzip_settings(draw: st.DrawFn) -> dict[str, Any]:
    """probe "latest" only: the reconstruction probe needs scores from outside the engine."""
    budget = draw(st.integers(1, 12))
    return {
        "budget": budget,
        "n_sink": draw(st.integers(0, budget - 1)),
        "probe": "latest",
        "signal": draw(st.sampled_from(SIGNALS)),
    }


@st.composite
def expected_attention_settings(draw: st.DrawFn) -> dict[str, Any]:
    """RoPE over at most 4 features (the smallest head the shapes draw)."""
    budget = draw(st.integers(1, 10))
    n_sink = draw(st.integers(0, budget - 1))
    return {
        "budget": budget,
        "n_sink": n_sink,
        "recent": draw(st.integers(0, budget - n_sink - 1)),
        "n_queries": draw(st.integers(1, 6)),
        "refresh_every": draw(st.integers(1, 4)),
        "n_future": draw(st.integers(1, 12)),
        "use_covariance": draw(st.booleans()),
        "use_vnorm": draw(st.booleans()),
        "epsilon": draw(st.sampled_from((0.0, 0.1))),
        "rope_base": draw(st.sampled_from((10.0, 1e4))),
        "rope_dims": draw(st.sampled_from((0, 2, 4))),
        "rope_traditional": draw(st.booleans()),
        "rope_scale": draw(st.sampled_from((1.0, 0.5))),
    }


def tova_step(step, call: Call) -> None:
    """The call attends over everything retained plus the chunk; the mask has one head per
    decision group: 1 for scope layer, else H_q with queries and H_kv without."""
    n_batch, n_kv, n, _ = step.keys.shape
    assert n == call.before.n_kept + call.length
    if step.mask is not None:
        settings = call.before.settings
        heads = 1 if settings["scope"] == "layer" else (call.n_q if call.give_queries else n_kv)
        assert step.mask.shape == (n_batch, heads, call.length, n)


def h2o_step(step, call: Call) -> None:
    """state.scores [B, G, S] is slot-aligned: each live slot holds its position's running sum."""
    state = step.state
    if state.n_kept == 0:
        return
    scores = np.array(state.scores)
    groups = scores.shape[1]
    assert (1 if call.ref.scope == "layer" else call.ref.n_kv) == groups
    positions = np.array(state.slots.positions)[:, :groups]
    free = None if state.slots.free is None else np.array(state.slots.free)[:, :groups]
    assert scores.shape[2] == positions.shape[2]
    for b in range(scores.shape[0]):
        for g in range(groups):
            for s in range(scores.shape[2]):
                if free is not None and free[b, g] == s:
                    continue
                want = call.ref.scores[b][g][int(positions[b, g, s])]
                np.testing.assert_allclose(scores[b, g, s], want, rtol=1e-4, atol=1e-5)


def streaming_llm_step(step, call: Call) -> None:
    """The rule ignores attention: one mask for every head."""
    if step.mask is not None:
        assert step.mask.shape[1] == 1


def snapkv_step(step, call: Call) -> None:
    """Nothing is evicted while the prompt is fed, nor after the cut: tokens only append."""
    state = step.state
    if call.ended:
        assert state.compressed and state.n_kept == call.before.n_kept + call.length
    else:
        assert not state.compressed and state.n_kept == state.offset


def expected_attention_step(step, call: Call) -> None:
    """Nothing is evicted before the cut; after it, state.scores [B, H_kv, S] is slot-aligned:
    each live slot holds its position's score, as the reference computed it."""
    state = step.state
    if not call.ended:
        assert not state.compressed and state.n_kept == state.offset
        return
    assert state.n_kept <= state.budget
    if state.scores is None:  # nothing fed yet
        assert state.n_kept == 0
        return
    scores = np.array(state.scores)
    positions = np.array(state.slots.positions)
    free = None if state.slots.free is None else np.array(state.slots.free)
    assert scores.shape == positions.shape
    for b, h, s in itertools.product(*map(range, scores.shape)):
        if free is None or free[b, h] != s:
            want = call.ref.scores[b][h][int(positions[b, h, s])]
            if abs(float(want)) > float(np.finfo(np.float32).max):  # past float32: inf
                assert np.isinf(scores[b, h, s]) and np.sign(scores[b, h, s]) == np.sign(want)
                continue
            np.testing.assert_allclose(scores[b, h, s], want, rtol=1e-4, atol=1e-6)


CASES: dict[str, Case] = {
    "tova": Case(
        settings={"budget": 5, "n_sink": 2},
        reference=ReferenceTova,
        strategy=tova_settings(),
        axes=ATTENTION_AXES,
        chunk_invariant={"prefill": "sequential"},
        check_step=tova_step,
        bad=[
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
            ({"preset": "nope"}, "preset"),
        ],
        ok=[{"budget": 1, "n_sink": 0}],
    ),
    "h2o": Case(
        settings={"budget": 6, "n_sink": 1, "recent": 2},
        reference=ReferenceH2O,
        strategy=h2o_settings(),
        axes=ATTENTION_AXES,
        chunk_invariant={"prefill": "sequential"},
        check_step=h2o_step,
        bad=[
            ({"budget": 6, "n_sink": 2, "recent": 5}, "recent"),
            ({"recent": -1}, "recent"),
            ({"recent": 1.0}, "recent"),
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
        ],
        ok=[{"budget": 8, "n_sink": 4, "recent": 4}, {"budget": 8, "n_sink": 0, "recent": 0}],
    ),
    "streaming_llm": Case(
        settings={"budget": 5, "n_sink": 2},
        reference=ReferenceStreamingLLM,
        strategy=streaming_llm_settings(),
        check_step=streaming_llm_step,
        uses_queries=False,
        ok=[{"budget": 1, "n_sink": 0}],
    ),
    "snapkv": Case(
        settings={"budget": 6, "window": 2, "kernel": 3},
        reference=ReferenceSnapKV,
        strategy=snapkv_settings(),
        axes={"signal": SIGNALS, "kernel": (1, 5)},
        prompt_end=snapkv_compress,
        check_step=snapkv_step,
        bad=[
            ({"budget": 6, "window": 6}, "window"),
            ({"budget": 6, "window": 0}, "window"),
            ({"kernel": 4}, "kernel"),
            ({"kernel": 0}, "kernel"),
            ({"signal": "value"}, "signal"),
            ({"budget": 1, "window": 1}, "budget"),
            ({"allocation": "all"}, "allocation"),
            ({"allocation": "head", "allocation_floor": -1.0}, "allocation_floor"),
        ],
        ok=[{"budget": 2, "window": 1, "kernel": 1}, {"allocation": "head"}],
    ),
    "morphkv": Case(
        settings={"budget": 6, "n_sink": 1, "window": 3},
        reference=ReferenceMorphKV,
        strategy=morphkv_settings(),
        axes={**ATTENTION_AXES, "fusion": ("mean", "max")},
        chunk_invariant={"prefill": "sequential"},
        bad=[
            ({"fusion": "sum"}, "fusion"),
            ({"window": 0}, "window"),
            ({"window": 2.0}, "window"),
            ({"budget": 6, "n_sink": 2, "window": 6}, "window"),
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
        ],
        ok=[{"budget": 8, "n_sink": 2, "window": 7}, {"budget": 8, "n_sink": 2, "window": 1}],
    ),
    "kvzip": Case(
        settings={"budget": 5, "n_sink": 1, "probe": "latest"},
        reference=ReferenceKVzip,
        strategy=kvzip_settings(),
        axes={"signal": SIGNALS},
        prompt_end=kvzip_end_prompt,
        check_step=snapkv_step,  # the same shape: whole until the cut, appending after it
        bad=[
            ({"probe": "query"}, "probe"),
            ({"after": "h2o"}, "after"),
            ({"signal": "value"}, "signal"),
            ({"allocation": "token"}, "allocation"),
            ({"allocation": "layer"}, "allocation"),  # the old name, only in saved caches
            ({"allocation_floor": 2.0}, "allocation_floor"),
            # TOVA's rule needs one budget per head
            ({"after": "tova", "allocation": "global"}, "allocation"),
        ],
        ok=[
            {"budget": 1, "n_sink": 0},
            {"probe": "reconstruct"},
            {"after": "tova"},
            {"allocation": "head", "allocation_floor": 0.0},
        ],
    ),
    "expected_attention": Case(
        settings={
            "budget": 5,
            "n_sink": 1,
            "recent": 2,
            "n_queries": 3,  # with n_future 8: no near tie on the fixed streams
            "refresh_every": 3,
            "n_future": 8,
            "rope_base": 100.0,
            "rope_dims": 4,
        },
        reference=ReferenceExpectedAttention,
        strategy=expected_attention_settings(),
        axes={
            "use_covariance": (True, False),
            "use_vnorm": (True, False),
            "rope_traditional": (False, True),
        },
        prompt_end=expected_attention_compress,
        check_step=expected_attention_step,
        bad=[
            ({"budget": 6, "n_sink": 2, "recent": 4}, "recent"),
            ({"recent": -1}, "recent"),
            ({"recent": 1.0}, "recent"),
            ({"n_queries": 0}, "n_queries"),
            ({"n_queries": 2.0}, "n_queries"),
            ({"refresh_every": 0}, "refresh_every"),
            ({"refresh_every": None}, "refresh_every"),
            ({"n_future": 0}, "n_future"),
            ({"n_future": "512"}, "n_future"),
            ({"use_covariance": 1}, "use_covariance"),
            ({"use_vnorm": "yes"}, "use_vnorm"),
            ({"epsilon": -0.1}, "epsilon"),
            ({"epsilon": math.inf}, "epsilon"),
            ({"epsilon": "0"}, "epsilon"),
            ({"rope_base": 1.0}, "rope_base"),
            ({"rope_base": math.nan}, "rope_base"),
            ({"rope_base": "1e4"}, "rope_base"),
            ({"rope_dims": 3}, "rope_dims"),
            ({"rope_dims": -2}, "rope_dims"),
            ({"rope_dims": 4.0}, "rope_dims"),
            ({"rope_traditional": 0}, "rope_traditional"),
            ({"rope_scale": 0.0}, "rope_scale"),
            ({"rope_scale": -1.0}, "rope_scale"),
        ],
        ok=[
            {"budget": 1, "n_sink": 0, "recent": 0},
            {"budget": 8, "n_sink": 4, "recent": 3},
            {"budget": 8, "n_sink": 0, "recent": 0},
            {"n_queries": 1, "refresh_every": 1, "n_future": 1},
            {"epsilon": 0.5, "use_vnorm": False},
            {"rope_dims": 0},
            {"rope_base": 1e6, "rope_scale": 0.125, "rope_traditional": True},
        ],
    ),
}

# ------------------------------------------------------------------------------- helpers

NAMES = sorted(POLICIES)
B, H, GROUP, D = 2, 2, 2, 8
CHUNKINGS = [[1] * 14, [14], [3, 0, 5, 1, 4, 1], [6, 6, 1, 1]]
EXAMPLES = hypothesis_settings(
    max_examples=35,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def stream(n: int, b: int = B, h: int = H, d: int = D, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((b, h, n, d)).astype(dtype)
    values = rng.standard_normal((b, h, n, d)).astype(dtype)
    queries = rng.standard_normal((b, h * GROUP, n, d)).astype(dtype)
    return keys, values, queries


def fresh(name: str, **overrides):
    return POLICIES[name].init(**{**CASES[name].settings, **overrides})


def call(name: str, state, keys, values, queries, **kwargs):
    return POLICIES[name].update(state, keys, values, queries, **kwargs)


def feed(name: str, chunks: list[int], state=None, seed: int = 0, dtype=np.float32):
    """Feed a stream in chunks; returns (steps, numpy stream)."""
    state = fresh(name) if state is None else state
    keys, values, queries = stream(sum(chunks), seed=seed, dtype=dtype)
    steps, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        args = (mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        step = call(name, state, *args, mx.array(queries[:, :, part]))
        steps.append(step)
        state = step.state
        start += size
    return steps, (keys, values, queries)


def finish(name: str, state):
    """End of the prompt: the policy's prompt_end, if any."""
    prompt_end = CASES[name].prompt_end
    return state if prompt_end is None else prompt_end(state)


def needs_queries(name: str, settings: dict[str, Any]) -> bool:
    """Whether an update under these (full) settings must get the queries."""
    return CASES[name].uses_queries and settings.get("signal", "query") == "query"


def snapshot(state) -> dict:
    """Every array and scalar a state holds, as numpy / Python values."""
    out: dict = {}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if value is None or isinstance(value, (int, float, str, bool)):
            out[field.name] = value
        elif isinstance(value, mx.array):
            out[field.name] = np.array(value)
        else:  # KVSlots, History: dataclasses of arrays
            for sub in dataclasses.fields(value):
                x = getattr(value, sub.name)
                out[f"{field.name}.{sub.name}"] = None if x is None else np.array(x)
    return out


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, want in before.items():
        got = after[key]
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            assert got == want, key


# ------------------------------------------------------------------------------ registry


def test_matrix_covers_every_policy() -> None:
    assert set(CASES) == set(POLICIES)


@pytest.mark.parametrize("name", NAMES)
def test_registry_entry(name: str) -> None:
    policy = POLICIES[name]
    assert isinstance(policy, Policy) and policy.name == name
    state = fresh(name)
    assert isinstance(state, policy.state_type)
    assert policy.uses_queries == CASES[name].uses_queries
    # Settings round-trip: a saved cache can be rebuilt from them.
    assert policy.init(**state.settings).settings == state.settings
    assert state.n_kept == 0 and state.offset == 0 and state.tokens_seen == 0
    assert state.keys is None and state.positions is None and state.nbytes == 0
    assert state.compression_ratio == 1.0


# ------------------------------------------------------------------------ the guarantees


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", NAMES)
def test_guarantees_after_every_call(name: str, chunks: list[int]) -> None:
    settings = CASES[name].settings
    budget, n_sink = settings["budget"], settings.get("n_sink")
    steps, (keys, values, _) = feed(name, chunks)
    offset = 0
    for step, size in zip(steps, chunks, strict=True):
        offset += size
        state = step.state
        # What the call's queries attend over.
        assert step.keys.shape[:2] == (B, H) and step.keys.shape[3] == D
        assert step.values.shape == step.keys.shape
        if size > 1:
            assert step.mask is not None
        if step.mask is not None:
            assert step.mask.dtype == mx.bool_
            assert step.mask.shape[0] == B and step.mask.shape[1] in (1, H, H * GROUP)
            assert step.mask.shape[2:] == (size, step.keys.shape[2])
        # Budget (a policy with a prompt end only cuts there: it grows until then).
        if CASES[name].prompt_end is not None:
            assert state.n_kept == offset
        else:
            assert state.n_kept == min(offset, budget)
        check_state(state, offset, keys, values, n_sink)
        held = state.slots.n_held
        if CASES[name].prompt_end is None:  # reserved rows never pass the decode bound
            assert held <= max(budget + 1, state.slots.n_slots)
    state = finish(name, steps[-1].state)
    assert state.n_kept == min(offset, budget)
    check_state(state, offset, keys, values, n_sink)


def check_state(state, offset: int, keys, values, n_sink: int | None) -> None:
    n = state.n_kept
    assert state.offset == offset
    assert state.tokens_seen == B * H * offset
    assert state.tokens_kept == n
    assert state.keys.shape == state.values.shape == (B, H, n, D)
    assert state.positions.shape == (B, H, n)
    # The bytes held: kept rows, a decode step's dead slot, and rows a growing store reserved.
    held = state.slots.n_held
    assert state.slots.n_slots in (n, n + 1) and n <= held <= state.slots.n_slots + GROW
    assert state.nbytes == B * H * held * D * 2 * 4
    if n == offset:
        assert state.compression_ratio == 1.0
    else:
        assert math.isclose(state.compression_ratio, offset / n)
    positions = np.array(state.positions)
    stored_keys, stored_values = np.array(state.keys), np.array(state.values)
    for b in range(B):
        for h in range(H):
            row = positions[b, h]
            assert len(set(row.tolist())) == n and (row >= 0).all() and (row < offset).all()
            # Rows are the original key and value of their true position.
            np.testing.assert_array_equal(stored_keys[b, h], keys[b, h, row])
            np.testing.assert_array_equal(stored_values[b, h], values[b, h, row])
            if n_sink is not None:
                assert set(range(min(n_sink, offset))) <= set(row.tolist())


@pytest.mark.parametrize("name", NAMES)
def test_budget_holds_over_a_long_decode(name: str) -> None:
    budget = CASES[name].settings["budget"]
    steps, _ = feed(name, [9])
    state = finish(name, steps[-1].state)
    steps, _ = feed(name, [1] * 30, state=state, seed=1)
    sizes = [s.state.n_kept for s in steps]
    if POLICIES[name].grows_after_prompt_end:  # after the cut the cache grows
        assert sizes == [budget + i for i in range(1, 31)]
    else:
        assert sizes == [budget] * 30
    assert steps[-1].state.offset == 39


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("name", NAMES)
def test_nbytes(name: str, dtype) -> None:
    steps, _ = feed(name, [4, 7], dtype=dtype)
    state = finish(name, steps[-1].state)
    itemsize = np.dtype(dtype).itemsize
    assert state.keys.dtype == (mx.float16 if dtype == np.float16 else mx.float32)
    assert state.nbytes == B * H * state.slots.n_held * D * 2 * itemsize


@pytest.mark.parametrize("name", NAMES)
def test_empty_call(name: str) -> None:
    steps, _ = feed(name, [0, 3, 0, 9, 0])
    for step, before in zip(steps, [0, 3, 3, 12, 12], strict=True):
        assert step.state.offset == before
    assert steps[0].keys.shape == (B, H, 0, D)
    assert steps[-1].state.n_kept == steps[-2].state.n_kept
    assert steps[-1].state.tokens_seen == B * H * 12


@pytest.mark.parametrize("name", NAMES)
def test_call_leaves_input_state_untouched(name: str) -> None:
    steps, _ = feed(name, [7, 1])
    state = steps[-1].state
    before = snapshot(state)
    keys, values, queries = stream(4, seed=9)
    for size in (1, 4):
        part = slice(0, size)
        args = (mx.array(keys[:, :, part]), mx.array(values[:, :, part]))
        after = call(name, state, *args, mx.array(queries[:, :, part])).state
        mx.eval(after.keys)
        assert_same_snapshot(before, snapshot(state))
    if CASES[name].prompt_end is not None:
        CASES[name].prompt_end(state)
        assert_same_snapshot(before, snapshot(state))


# ---------------------------------------------------------------- against the reference


def run_against_reference(
    name: str,
    settings: dict[str, Any],
    *,
    shape: tuple[int, int, int, int],
    prompt: list[int],
    decode: list[int],
    give_queries: bool,
    scale: float | None,
    seed: int,
    close_call: Callable[[bool], Any] = assume,
    quant: Quant | None = None,
    pins: tuple[int, int] | None = None,
) -> None:
    """Feed engine and reference the same stream: the prompt in chunks, the prompt end (if the
    policy has one), then the decode chunks; compare them after every call.

    With ``quant`` the engine gets each call's keys and values quantized, and the reference
    the same rows dequantized: quantized rows must be kept, scored and attended exactly as
    full-precision rows holding their dequantized values. ``pins``: a span ``[start, stop)``
    pinned before the first call (the reference never evicts its positions either)."""
    case = CASES[name]
    policy = POLICIES[name]
    length = sum(prompt)
    stream = harness.make_stream(*shape, length + sum(decode), seed)
    update = policy.update
    if quant is not None:
        stream, update = quantized_stream(policy, quant, stream)
    state = policy.init(**settings)
    ref = case.reference(**state.settings)
    if pins is not None:
        state = pin(policy, state, *pins)
        ref.pinned = set(range(*pins))
    n_q = shape[1] * shape[2]

    def hook(ended: bool):
        if case.check_step is None:
            return None

        def after_call(step, ref, before) -> None:
            n = step.state.offset - before.offset
            case.check_step(step, Call(before, n, n_q, give_queries, ref, ended))

        return after_call

    common = {"give_queries": give_queries, "scale": scale, "close_call": close_call}
    state = harness.run_stream(update, state, ref, stream, prompt, after_call=hook(False), **common)
    if case.prompt_end is None:
        assert not decode
    else:
        state = case.prompt_end(state)
        ref.compress()
        close_call(ref.min_margin > harness.MIN_MARGIN)
        assert state.n_kept == min(length, state.settings["budget"])
        if length:
            harness.check_state(state, ref, length)
        assert case.prompt_end(state) is state  # once is enough
        state = harness.run_stream(
            update, state, ref, stream, decode, start=length, after_call=hook(True), **common
        )
    assert state.offset == ref.offset == length + sum(decode)


def quantized_stream(policy: Any, quant: Quant, stream: tuple) -> tuple[tuple, Callable[..., Any]]:
    """(the stream with keys and values dequantized, an update that feeds the engine the
    original rows quantized): the reference sees exactly what the quantized store holds."""
    keys, values, queries = stream
    q_keys, q_values = quant.quantize(mx.array(keys)), quant.quantize(mx.array(values))
    if quant.keys == "channel":
        # Per-channel keys stay at full precision until a group's worth of rows has come: the
        # streams here are shorter, so the store holds (and the reference sees) the keys.
        assert keys.shape[2] < quant.group_size
        seen = (keys, np.array(q_values.dense()), queries)
    else:
        seen = (np.array(q_keys.dense()), np.array(q_values.dense()), queries)

    def update(state: Any, k: mx.array, v: mx.array, **kwargs: Any) -> Any:
        part = slice(state.offset, state.offset + int(k.shape[2]))
        np.testing.assert_array_equal(np.array(k), seen[0][:, :, part])
        call_keys = (
            quant.quantize_keys(mx.array(keys[:, :, part]))
            if quant.keys == "channel"
            else q_keys[:, :, part]
        )
        return policy.update(state, call_keys, q_values[:, :, part], **kwargs)

    return seen, update


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.data())
def test_engine_matches_reference(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    settings = data.draw(case.strategy, label="settings")
    full = POLICIES[name].init(**settings).settings
    run_against_reference(
        name,
        settings,
        shape=data.draw(harness.shapes(), label="shape"),
        prompt=data.draw(harness.chunk_sizes(), label="prompt"),
        decode=(
            data.draw(st.lists(st.integers(0, 3), max_size=4), label="decode")
            if case.prompt_end is not None
            else []
        ),
        give_queries=needs_queries(name, full) or data.draw(st.booleans(), label="queries"),
        scale=data.draw(st.sampled_from([None, None, 0.3, 1.5]), label="scale"),
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
    )


def every_combination() -> list:
    params = []
    for name in NAMES:
        axes = CASES[name].axes
        for values in itertools.product(*axes.values()):
            combination = dict(zip(axes, values, strict=True))
            params.append(pytest.param(name, combination, id="-".join([name, *map(str, values)])))
    return params


# Fixed, eviction-heavy streams, so that every combination runs whatever hypothesis draws.
FIXED_CHUNKINGS = [[1] * 16, [7, 0, 1, 6, 3], [16], [4, 4, 4, 4]]


@pytest.mark.parametrize(("name", "combination"), every_combination())
def test_engine_matches_reference_every_combination(name: str, combination: dict) -> None:
    settings = {**CASES[name].settings, **combination}
    full = POLICIES[name].init(**settings).settings
    for i, chunks in enumerate(FIXED_CHUNKINGS):
        run_against_reference(
            name,
            settings,
            shape=(2, 2, 2, 8),
            prompt=chunks,
            decode=[1, 1, 2] if CASES[name].prompt_end is not None else [],
            give_queries=i % 2 == 0 or needs_queries(name, full),
            scale=None,
            seed=1000 + i,
            close_call=harness.assert_clear,
        )


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.data())
def test_chunk_invariant(name: str, data: st.DataObject) -> None:
    """How a stream is cut into calls changes nothing (under the `chunk_invariant` settings):
    not the reference, not the engine's states and outputs, not the prompt end."""
    case = CASES[name]
    policy = POLICIES[name]
    settings = {**data.draw(case.strategy, label="settings"), **case.chunk_invariant}
    length, split_a, split_b = data.draw(harness.two_splits(), label="splits")
    shape = data.draw(harness.shapes(), label="shape")
    stream = harness.make_stream(*shape, length, data.draw(st.integers(0, 2**31 - 1), label="seed"))
    full = policy.init(**settings).settings

    # The reference follows its own definition whatever the split.
    ref_a, ref_b = case.reference(**full), case.reference(**full)
    ref_out_a = harness.run_reference(ref_a, stream, split_a)
    ref_out_b = harness.run_reference(ref_b, stream, split_b)
    assert ref_a.positions() == ref_b.positions()
    np.testing.assert_allclose(ref_out_a, ref_out_b, atol=1e-12)
    if case.prompt_end is not None:
        ref_a.compress()
        ref_b.compress()
        assert ref_a.positions() == ref_b.positions()
    assume(min(ref_a.min_margin, ref_b.min_margin) > harness.MIN_MARGIN)

    state_a, out_a = harness.run_engine(policy.update, policy.init(**settings), stream, split_a)
    state_b, out_b = harness.run_engine(
        policy.update, policy.init(**settings), stream, split_b, needs_queries(name, full)
    )
    np.testing.assert_allclose(out_a, out_b, atol=harness.ATOL, rtol=harness.RTOL)
    np.testing.assert_allclose(out_a, ref_out_a, atol=harness.ATOL, rtol=harness.RTOL)
    if case.prompt_end is not None:
        state_a, state_b = case.prompt_end(state_a), case.prompt_end(state_b)
    harness.assert_same_states(state_a, state_b)
    assert state_a.offset == length
    assert state_a.n_kept == min(length, full["budget"])
    assert harness.state_positions(state_a) == (ref_a.positions() if length else None)


# -------------------------------------------------------------------------- bad inputs


def bad_calls(name: str, signal: str | None):
    """(description, parameter the message must name, args, kwargs) of calls that must fail."""
    k, v, q = (mx.array(x) for x in stream(3, seed=5))
    other = "tova" if name != "tova" else "h2o"

    def broken(value: float) -> mx.array:
        keys = np.array(k)
        keys[1, 0, 2, 3] = value
        return mx.array(keys)

    out = [
        ("keys rank", "keys", (k[:, :, 0], v, q), {}),
        ("values rank", "values", (k, v[None], q), {}),
        ("queries rank", "queries", (k, v, q[0]), {}),
        ("values L", "values", (k, v[:, :, :2], q), {}),
        ("values D", "values", (k, v[..., :4], q), {}),
        ("values B", "values", (k, v[:1], q), {}),
        ("values dtype", "values", (k, v.astype(mx.float16), q), {}),
        ("state dtype", "keys", (k.astype(mx.float16), v.astype(mx.float16), q), {}),
        ("integer keys", "keys", (k.astype(mx.int32), v.astype(mx.int32), q), {}),
        ("numpy keys", "keys", (np.array(k), v, q), {}),
        ("B change", "B", (k[:1], v[:1], q[:1]), {}),
        ("H_kv change", "H_kv", (k[:, :1], v[:, :1], q), {}),
        ("D change", "D", (k[..., :4], v[..., :4], q[..., :4]), {}),
        ("queries L", "queries", (k, v, q[:, :, :2]), {}),
        ("queries D", "queries", (k, v, q[..., :4]), {}),
        ("queries B", "queries", (k, v, q[:1]), {}),
        ("queries H_q", "H_q", (k, v, q[:, :3]), {}),
        ("NaN keys", "keys", (broken(math.nan), v, q), {}),
        ("inf keys", "keys", (broken(math.inf), v, q), {}),
        ("-inf keys", "keys", (broken(-math.inf), v, q), {}),
        ("scale sign", "scale", (k, v, q), {"scale": -1.0}),
        ("scale zero", "scale", (k, v, q), {"scale": 0.0}),
        ("scale NaN", "scale", (k, v, q), {"scale": math.nan}),
        ("scale inf", "scale", (k, v, q), {"scale": math.inf}),
        ("scale type", "scale", (k, v, q), {"scale": "1"}),
        ("wrong state", "state", (k, v, q), {"state": fresh(other)}),
    ]
    if needs_queries(name, {"signal": signal or "query"}):
        out.append(("no queries", "queries", (k, v, None), {}))
    return out


def bad_input_cases() -> list:
    """Every policy with its fixed settings, and with signal "key" where it has a signal."""
    params = [pytest.param(name, None, id=name) for name in NAMES]
    params += [
        pytest.param(name, "key", id=f"{name}-key")
        for name in NAMES
        if "signal" in fresh(name).settings
    ]
    return params


@pytest.mark.parametrize(("name", "signal"), bad_input_cases())
def test_bad_input_raises_and_changes_nothing(name: str, signal: str | None) -> None:
    overrides = {} if signal is None else {"signal": signal}
    steps, _ = feed(name, [7, 1], state=fresh(name, **overrides))
    state = steps[-1].state
    before = snapshot(state)
    for what, param, args, kwargs in bad_calls(name, signal):
        target = kwargs.pop("state", state)
        with pytest.raises((ValueError, TypeError)) as info:
            call(name, target, *args, **kwargs)
        assert param in str(info.value), f"{what}: message does not name {param!r}: {info.value}"
        assert_same_snapshot(before, snapshot(state))
    keys, values, _ = (mx.array(x) for x in stream(1, seed=6))
    if needs_queries(name, state.settings):  # a fresh state too
        with pytest.raises((ValueError, TypeError), match="queries"):
            call(name, fresh(name, **overrides), keys, values, None)
    # The state still works after the failures.
    good = call(name, state, *(mx.array(x) for x in stream(1, seed=6))).state
    assert good.offset == 9


@pytest.mark.parametrize("name", NAMES)
def test_bad_settings_name_the_parameter(name: str) -> None:
    """A value of the wrong type raises TypeError, a wrong value of the right type ValueError;
    both name the parameter."""
    base = CASES[name].settings
    valid = fresh(name).settings
    budget = base["budget"]
    common: list[tuple[dict[str, Any], str]] = [
        ({"budget": 0}, "budget"),
        ({"budget": -3}, "budget"),
        ({"budget": "8"}, "budget"),
        ({"budget": True}, "budget"),
        ({"budget": 8.0}, "budget"),
        ({"budget": None}, "budget"),
    ]
    if "n_sink" in valid:
        common += [
            ({"n_sink": -1}, "n_sink"),
            ({"n_sink": budget}, "n_sink"),
            ({"n_sink": budget + 1}, "n_sink"),
            ({"n_sink": 1.5}, "n_sink"),
        ]
    for overrides, param in common + CASES[name].bad:
        wrong_type = param in overrides and param in valid
        wrong_type = wrong_type and type(overrides[param]) is not type(valid[param])
        with pytest.raises(TypeError if wrong_type else ValueError) as info:
            POLICIES[name].init(**{**base, **overrides})
        assert param in str(info.value), f"{overrides}: message does not name {param!r}"


@pytest.mark.parametrize("name", NAMES)
def test_edge_settings_are_accepted(name: str) -> None:
    for overrides in CASES[name].ok:
        state = POLICIES[name].init(**{**CASES[name].settings, **overrides})
        assert {k: state.settings[k] for k in overrides} == overrides
