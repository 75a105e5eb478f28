"""Packed rows (velox_cache_core.packed: pack / packed_update / unpack): a batch's decode steps
as one engine call with per-row positions give every row exactly what it gets decoding alone.

Rows start from prompts of different lengths (so different positions), decode packed, and are
unpacked: each row's kept positions and rows (bit for bit), counters, attention outputs
(float32 tolerance) and undo log must equal the row decoded alone, and a trim after unpacking
must give the same state as the same trim of the row alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES
from velox_cache_core.attention import attend
from velox_cache_core.packed import can_pack, pack, packed_update, unpack
from velox_cache_core.undo import new_log

PACKABLE = sorted(name for name, p in POLICIES.items() if p.packs_rows)
H_KV, GROUP, D = 2, 2, 8
SCALE = D**-0.5
EXAMPLES = hypothesis_settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# What both packing tests draw besides the budget, prompts and steps.
ROW_SETTINGS = {
    "n_sink": st.integers(0, 2),
    "window": st.sampled_from([0, 3, 16]),
    "trim": st.integers(0, 3),
    "seed": st.integers(0, 2**16),
}


def _settings(name: str, budget: int, n_sink: int) -> dict[str, Any]:
    out: dict[str, Any] = {"budget": budget, "n_sink": n_sink}
    if name == "h2o":
        out["recent"] = min(2, budget - n_sink)
    return out


def _stream(n: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, H_KV, n, D)).astype(np.float32)
    v = rng.standard_normal((1, H_KV, n, D)).astype(np.float32)
    q = rng.standard_normal((1, H_KV * GROUP, n, D)).astype(np.float32)
    return mx.array(k), mx.array(v), mx.array(q)


def _same_state(a: Any, b: Any) -> None:
    assert a.offset == b.offset and a.tokens_seen == b.tokens_seen
    if a.slots is None or b.slots is None:  # trimmed back before the first token
        assert a.slots is None and b.slots is None
        return
    for x, y in zip(a.slots.compact().arrays(), b.slots.compact().arrays(), strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    if getattr(a, "scores", None) is not None:
        np.testing.assert_allclose(np.array(a.scores), np.array(b.scores), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", PACKABLE)
@EXAMPLES
@given(
    budget=st.integers(4, 9),
    prompts=st.lists(st.integers(10, 20), min_size=2, max_size=3),
    steps=st.integers(1, 12),
    **ROW_SETTINGS,
)
def test_packed_rows_equal_rows_alone(
    name: str,
    budget: int,
    n_sink: int,
    prompts: list[int],
    steps: int,
    window: int,
    trim: int,
    seed: int,
) -> None:
    policy = POLICIES[name]
    streams = [_stream(n + steps, seed + i) for i, n in enumerate(prompts)]
    # Each row's prompt, fed alone; each has then evicted down to its budget. Then one decode
    # step alone, so that every row holds its dead slot (or, for StreamingLLM, a full budget):
    # the rows are laid out alike.
    alone = _fed(policy, _fresh(name, budget, n_sink, window, prompts), streams, prompts, 0)
    alone = _fed(policy, alone, streams, [1] * len(prompts), prompts)
    states, logs = [s for s, _ in alone], [lg for _, lg in alone]
    assert can_pack(policy, states)
    packed = pack(policy, states, logs)
    assert not packed.padded
    packed = _decode_both(policy, packed, alone, streams, [n + 1 for n in prompts], steps - 1)
    _check_unpacked(policy, packed, alone, trim)


Row = tuple[Any, Any]  # a row's state and undo log


def _fresh(name: str, budget: int, n_sink: int, window: int, prompts: list[int]) -> list[Row]:
    """An empty state and undo log per row."""
    policy = POLICIES[name]
    return [(policy.init(**_settings(name, budget, n_sink)), new_log(window)) for _ in prompts]


def _fed(
    policy: Any,
    rows: list[Row],
    streams: list[tuple[mx.array, mx.array, mx.array]],
    counts: list[int],
    starts: list[int] | int,
) -> list[Row]:
    """Each row fed alone, as one call, ``counts[b]`` tokens of its stream from ``starts[b]``."""
    firsts = [starts] * len(rows) if isinstance(starts, int) else starts
    out = []
    for (state, log), (k, v, q), a, n in zip(rows, streams, firsts, counts, strict=True):
        e = a + n
        step = policy.update(state, k[:, :, a:e], v[:, :, a:e], q[:, :, a:e], SCALE, log=log)
        out.append((step.state, step.log))
    return out


def _decode_both(
    policy: Any,
    packed: Any,
    alone: list[tuple[Any, Any]],
    streams: list[tuple[mx.array, mx.array, mx.array]],
    starts: list[int],
    steps: int,
) -> Any:
    """``steps`` decode steps of the packed rows and of each row alone (``alone``, updated),
    row ``b``'s tokens from ``streams[b]`` at ``starts[b]``: attention outputs must agree."""
    for t in range(steps):
        cols = [(n + t, n + t + 1) for n in starts]
        k, v, q = (
            mx.concatenate([s[i][:, :, a:b] for s, (a, b) in zip(streams, cols, strict=True)])
            for i in range(3)
        )
        step, packed = packed_update(policy, packed, k, v, q, SCALE)
        out = np.array(attend(q, step, SCALE))
        for b, ((state, log), (a, e)) in enumerate(zip(alone, cols, strict=True)):
            s = streams[b]
            one = policy.update(
                state, s[0][:, :, a:e], s[1][:, :, a:e], s[2][:, :, a:e], SCALE, log=log
            )
            alone[b] = (one.state, one.log)
            expect = np.array(attend(s[2][:, :, a:e], one, SCALE))
            np.testing.assert_allclose(out[b : b + 1], expect, rtol=1e-5, atol=1e-6)
    return packed


def _check_unpacked(policy: Any, packed: Any, alone: list[tuple[Any, Any]], trim: int) -> None:
    """Unpacked rows equal the rows alone: state, undo log and a trim of ``trim`` tokens."""
    assert packed.tokens_kept == [int(state.tokens_kept) for state, _ in alone]
    rows, row_logs = unpack(packed)
    for (state, log), row, row_log in zip(alone, rows, row_logs, strict=True):
        _same_state(row, state)
        if log is None:
            assert row_log is None
            continue
        assert row_log is not None and row_log.tokens == log.tokens
        n = min(trim, log.tokens)
        trimmed, _ = policy.trim(row, row_log, n)
        expect, _ = policy.trim(state, log, n)
        _same_state(trimmed, expect)


# Policies whose rows pack padded below their budget: no running arrays besides the slots.
PADDABLE = ["streaming_llm", "tova"]


@pytest.mark.parametrize("name", PADDABLE)
@EXAMPLES
@given(
    budget=st.integers(6, 24),
    fractions=st.lists(st.floats(0, 1), min_size=2, max_size=4),
    steps=st.integers(1, 24),
    **ROW_SETTINGS,
)
def test_padded_rows_equal_rows_alone(
    name: str,
    budget: int,
    n_sink: int,
    fractions: list[float],
    steps: int,
    window: int,
    trim: int,
    seed: int,
) -> None:
    """Rows below their budget, of different lengths, pack padded and decode packed until the
    longest would evict; each row then equals the row decoded alone."""
    policy = POLICIES[name]
    prompts = [1 + int(f * (budget - 2)) for f in fractions]  # 1 .. budget - 1 tokens
    streams = [_stream(n + steps, seed + i) for i, n in enumerate(prompts)]
    alone = _fed(policy, _fresh(name, budget, n_sink, window, prompts), streams, prompts, 0)
    states, logs = [s for s, _ in alone], [lg for _, lg in alone]
    assert can_pack(policy, states)
    packed = pack(policy, states, logs)
    assert list(packed.pads) == [max(prompts) - n for n in prompts]
    fits = min(steps, budget - max(prompts))  # steps until the longest row's budget
    packed = _decode_both(policy, packed, alone, streams, prompts, fits)
    if packed.padded:  # packed until the longest row's next step would evict
        assert packed.can_step() == (max(prompts) + fits + 1 <= budget)
    _check_unpacked(policy, packed, alone, trim)


def test_padded_rows_stop_at_the_budget() -> None:
    policy = POLICIES["tova"]
    k, v, q = _stream(8, 0)
    short = policy.update(policy.init(budget=6), k[:, :, :3], v[:, :, :3], q[:, :, :3]).state
    long = policy.update(policy.init(budget=6), k[:, :, :5], v[:, :, :5], q[:, :, :5]).state
    packed = pack(policy, [short, long], [None, None])
    assert packed.pads == (2, 0) and packed.tokens_kept == [3, 5]
    two = [mx.concatenate([x[:, :, 5:6]] * 2) for x in (k, v, q)]
    _, packed = packed_update(policy, packed, *two, SCALE)
    assert packed.tokens_kept == [4, 6] and not packed.can_step()
    with pytest.raises(ValueError, match="unpack them first"):
        packed_update(policy, packed, *two, SCALE)
    # A row at its budget and H2O's running scores do not pack padded.
    full = policy.update(policy.init(budget=6), k[:, :, :6], v[:, :, :6], q[:, :, :6]).state
    assert not can_pack(policy, [short, full])
    h2o = POLICIES["h2o"]
    rows = [
        h2o.update(h2o.init(budget=6, recent=1), k[:, :, :n], v[:, :, :n], q[:, :, :n]).state
        for n in (3, 5)
    ]
    assert not can_pack(h2o, rows)


def test_rows_laid_out_differently_do_not_pack() -> None:
    policy = POLICIES["tova"]
    k, v, q = _stream(12, 0)
    full = policy.update(policy.init(budget=6), k, v, q, SCALE).state
    short = policy.update(policy.init(budget=6), k[:, :, :4], v[:, :, :4], q[:, :, :4]).state
    assert not can_pack(policy, [full, short])
    assert not can_pack(POLICIES["morphkv"], [full, full])  # MorphKV does not pack


def test_row_start_is_checked() -> None:
    policy = POLICIES["tova"]
    k, v, q = _stream(12, 0)
    state = policy.update(policy.init(budget=6), k, v, q, SCALE).state
    two = mx.concatenate([k[:, :, :1]] * 2), mx.concatenate([q[:, :, :1]] * 2)
    packed = pack(policy, [state, state], [None, None])
    with pytest.raises(ValueError, match="row_start must be 2 ints"):
        policy.update(packed.state, two[0], two[0], two[1], SCALE, row_start=[1])
    with pytest.raises(ValueError, match=r"row_start\[1\] must be an int >= 0"):
        policy.update(packed.state, two[0], two[0], two[1], SCALE, row_start=[1, -1])
    with pytest.raises(ValueError, match="L = 1"):
        kk = mx.concatenate([k[:, :, :2]] * 2)
        policy.update(packed.state, kk, kk, mx.concatenate([q[:, :, :2]] * 2), row_start=[1, 2])
    with pytest.raises(ValueError, match="does not decide packed rows"):
        POLICIES["morphkv"].update(
            POLICIES["morphkv"].init(budget=16),
            k[:, :, :1],
            k[:, :, :1],
            q[:, :, :1],
            row_start=[0],
        )
