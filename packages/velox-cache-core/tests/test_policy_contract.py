"""One contract matrix over every policy in the registry (DESIGN.md sections 3-4): what stays true
whatever the rule. Per-policy behaviour is tested in test_<policy>.py."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import POLICIES, Policy, snapkv_compress

B, H, GROUP, D = 2, 2, 2, 8

# Small settings per policy, the sink count they promise to keep (None: no sinks), and the
# bad settings each must refuse, with the parameter the message must name.
CASES: dict[str, dict] = {
    "tova": {
        "settings": {"budget": 5, "n_sink": 2},
        "n_sink": 2,
        "bad": [
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
            ({"preset": "nope"}, "preset"),
        ],
    },
    "h2o": {
        "settings": {"budget": 6, "n_sink": 1, "recent": 2},
        "n_sink": 1,
        "bad": [
            ({"budget": 6, "n_sink": 2, "recent": 5}, "recent"),
            ({"recent": -1}, "recent"),
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
        ],
    },
    "streaming_llm": {"settings": {"budget": 5, "n_sink": 2}, "n_sink": 2, "bad": []},
    "snapkv": {
        "settings": {"budget": 6, "window": 2, "kernel": 3},
        "n_sink": None,
        "bad": [
            ({"budget": 6, "window": 6}, "window"),
            ({"budget": 6, "window": 0}, "window"),
            ({"kernel": 4}, "kernel"),
            ({"kernel": 0}, "kernel"),
            ({"signal": "value"}, "signal"),
            ({"budget": 1, "window": 1}, "budget"),
        ],
    },
    "morphkv": {
        "settings": {"budget": 6, "n_sink": 1, "window": 3},
        "n_sink": 1,
        "bad": [
            ({"fusion": "sum"}, "fusion"),
            ({"window": 0}, "window"),
            ({"budget": 6, "n_sink": 2, "window": 6}, "window"),
            ({"signal": "value"}, "signal"),
            ({"scope": "token"}, "scope"),
            ({"prefill": "lazy"}, "prefill"),
        ],
    },
}
NAMES = sorted(POLICIES)
CHUNKINGS = [[1] * 14, [14], [3, 0, 5, 1, 4, 1], [6, 6, 1, 1]]


def stream(n: int, b: int = B, h: int = H, d: int = D, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((b, h, n, d)).astype(dtype)
    values = rng.standard_normal((b, h, n, d)).astype(dtype)
    queries = rng.standard_normal((b, h * GROUP, n, d)).astype(dtype)
    return keys, values, queries


def fresh(name: str, **overrides):
    return POLICIES[name].init(**{**CASES[name]["settings"], **overrides})


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
    """End of the prompt: SnapKV cuts here; the others already respect the budget."""
    return snapkv_compress(state) if name == "snapkv" else state


def kept(state) -> list[list[list[int]]]:
    return [[sorted(int(p) for p in row) for row in rows] for rows in np.array(state.positions)]


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
    assert policy.uses_queries == (name != "streaming_llm")
    # Settings round-trip: a saved cache can be rebuilt from them.
    assert policy.init(**state.settings).settings == state.settings
    assert state.n_kept == 0 and state.offset == 0 and state.tokens_seen == 0
    assert state.keys is None and state.positions is None and state.nbytes == 0
    assert state.compression_ratio == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_state_is_frozen(name: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        fresh(name).budget = 3


# ------------------------------------------------------------------------ the guarantees


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("name", NAMES)
def test_guarantees_after_every_call(name: str, chunks: list[int]) -> None:
    case = CASES[name]
    budget, n_sink = case["settings"]["budget"], case["n_sink"]
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
        # Budget (SnapKV only cuts at the end of the prompt: it grows until then).
        if name == "snapkv":
            assert state.n_kept == offset
        else:
            assert state.n_kept == min(offset, budget)
        check_state(state, offset, keys, values, n_sink)
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
    assert state.nbytes == B * H * n * D * 2 * 4
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
    budget = CASES[name]["settings"]["budget"]
    steps, _ = feed(name, [9])
    state = finish(name, steps[-1].state)
    steps, _ = feed(name, [1] * 30, state=state, seed=1)
    sizes = [s.state.n_kept for s in steps]
    if name == "snapkv":  # after the cut the cache grows
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
    assert state.nbytes == B * H * state.n_kept * D * 2 * itemsize


@pytest.mark.parametrize("name", NAMES)
def test_empty_call(name: str) -> None:
    steps, _ = feed(name, [0, 3, 0, 9, 0])
    for step, before in zip(steps, [0, 3, 3, 12, 12], strict=True):
        assert step.state.offset == before
    assert steps[0].keys.shape == (B, H, 0, D)
    assert steps[-1].state.n_kept == steps[-2].state.n_kept
    assert steps[-1].state.tokens_seen == B * H * 12


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str) -> None:
    chunks = [3, 1, 6, 1, 1, 5]
    a, _ = feed(name, chunks)
    b, _ = feed(name, chunks)
    for x, y in zip(a, b, strict=True):
        for what in ("keys", "values", "mask"):
            u, v = getattr(x, what), getattr(y, what)
            assert (u is None) == (v is None)
            if u is not None:
                np.testing.assert_array_equal(np.array(u), np.array(v), err_msg=what)
        assert_same_snapshot(snapshot(x.state), snapshot(y.state))


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
    if name == "snapkv":
        snapkv_compress(state)
        assert_same_snapshot(before, snapshot(state))


# -------------------------------------------------------------------------- bad inputs


def bad_calls(name: str, state):
    """(description, parameter the message must name, args, kwargs) of calls that must fail."""
    k, v, q = (mx.array(x) for x in stream(3, seed=5))
    other = "tova" if name != "tova" else "h2o"
    out = [
        ("keys rank", "keys", (k[:, :, 0], v, q), {}),
        ("values rank", "values", (k, v[None], q), {}),
        ("queries rank", "queries", (k, v, q[0]), {}),
        ("values shape", "values", (k, v[:, :, :2], q), {}),
        ("values dtype", "values", (k, v.astype(mx.float16), q), {}),
        ("state dtype", "keys", (k.astype(mx.float16), v.astype(mx.float16), q), {}),
        ("integer keys", "keys", (k.astype(mx.int32), v.astype(mx.int32), q), {}),
        ("numpy keys", "keys", (np.array(k), v, q), {}),
        ("B change", "B", (k[:1], v[:1], q[:1]), {}),
        ("H_kv change", "H_kv", (k[:, :1], v[:, :1], q), {}),
        ("D change", "D", (k[..., :4], v[..., :4], q[..., :4]), {}),
        ("queries L", "queries", (k, v, q[:, :, :2]), {}),
        ("queries H_q", "H_q", (k, v, q[:, :3]), {}),
        ("scale sign", "scale", (k, v, q), {"scale": -1.0}),
        ("scale type", "scale", (k, v, q), {"scale": "1"}),
        ("NaN keys", "keys", (k * mx.array(math.nan), v, q), {}),
        ("wrong state", "state", (k, v, q), {"state": fresh(other)}),
    ]
    if POLICIES[name].uses_queries:
        out.append(("no queries", "queries", (k, v, None), {}))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises_and_changes_nothing(name: str) -> None:
    steps, _ = feed(name, [7, 1])
    state = steps[-1].state
    before = snapshot(state)
    for what, param, args, kwargs in bad_calls(name, state):
        target = kwargs.pop("state", state)
        with pytest.raises((ValueError, TypeError)) as info:
            call(name, target, *args, **kwargs)
        assert param in str(info.value), f"{what}: message does not name {param!r}: {info.value}"
        assert_same_snapshot(before, snapshot(state))
    # The state still works after the failures.
    good = call(name, state, *(mx.array(x) for x in stream(1, seed=6))).state
    assert good.offset == 9


@pytest.mark.parametrize("name", NAMES)
def test_bad_settings_name_the_parameter(name: str) -> None:
    base = CASES[name]["settings"]
    common = [
        ({"budget": 0}, "budget"),
        ({"budget": "8"}, "budget"),
        ({"budget": True}, "budget"),
    ]
    if CASES[name]["n_sink"] is not None:
        common += [
            ({"n_sink": -1}, "n_sink"),
            ({"n_sink": base["budget"]}, "n_sink"),
            ({"n_sink": 1.5}, "n_sink"),
        ]
    for overrides, param in common + CASES[name]["bad"]:
        with pytest.raises((ValueError, TypeError)) as info:
            POLICIES[name].init(**{**base, **overrides})
        assert param in str(info.value), f"{overrides}: message does not name {param!r}"
