"""Batches of independent sequences (velox_cache_core.batch): row equivalence and the batch
operations.

Row equivalence: row ``b`` of a batched run keeps the same positions (bit for bit the same
rows) and gives the same attention outputs as the same sequence fed alone, whose reference
(core_reference*.py) it is also checked against. Padding is filled with huge values, so a
padded token that leaked into a row's scores, keys or outputs would show.
"""

from __future__ import annotations

import core_harness as harness
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from test_policy_contract import CASES

from velox_cache_core import POLICIES, batch
from velox_cache_core.undo import new_log

NAMES = sorted(CASES)
EXAMPLES = hypothesis_settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PAD = 1e3  # padding value: large enough that any leak changes a decision or an output


@st.composite
def schedules(draw: st.DrawFn) -> dict:
    """Calls of a batch: each call's length and every row's (left padding, real count); rows
    may have no token in a call (joining late), a row may be dropped between calls, and a row
    may join after the first calls."""
    n_rows = draw(st.integers(1, 3))
    n_calls = draw(st.integers(1, 5))
    calls = []
    for _ in range(n_calls):
        length = draw(st.integers(1, 6))
        row_spans = []
        for _ in range(n_rows + 1):  # one spare row for the late joiner
            pad = draw(st.integers(0, length))
            count = draw(st.integers(0, length - pad))
            row_spans.append((pad, count))
        calls.append((length, row_spans))
    drop_at = draw(st.integers(0, n_calls))  # before this call, drop one row (if > 1 left)
    join_at = draw(st.integers(0, n_calls))  # before this call, the spare row joins
    return {"rows": n_rows, "calls": calls, "drop_at": drop_at, "join_at": join_at}


def padded_call(streams, cursors, rows, length, row_spans, n_kv, n_q, dim):
    """The call's padded keys/values/queries [B, H, L, D] and each row's real chunk."""
    shape_kv, shape_q = (len(rows), n_kv, length, dim), (len(rows), n_q, length, dim)
    k = np.full(shape_kv, PAD, np.float32)
    v = np.full(shape_kv, PAD, np.float32)
    q = np.full(shape_q, PAD, np.float32)
    chunks = []
    for i, (row, (pad, count)) in enumerate(zip(rows, row_spans, strict=True)):
        keys, values, queries = streams[row]
        part = slice(cursors[row], cursors[row] + count)
        k[i, :, pad : pad + count] = keys[0, :, part]
        v[i, :, pad : pad + count] = values[0, :, part]
        q[i, :, pad : pad + count] = queries[0, :, part]
        chunks.append((keys[:, :, part], values[:, :, part], queries[:, :, part]))
        cursors[row] += count
    return k, v, q, chunks


@pytest.mark.parametrize("name", NAMES)
@EXAMPLES
@given(data=st.data())
def test_rows_equal_single_sequences(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    policy = POLICIES[name]
    settings = data.draw(case.strategy, label="settings")
    _, n_kv, group, dim = data.draw(harness.shapes(), label="shape")
    schedule = data.draw(schedules(), label="schedule")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    n_q = n_kv * group
    end_at = data.draw(st.integers(0, len(schedule["calls"])), label="prompt end before call")

    n_rows = schedule["rows"] + 1
    total = 6 * len(schedule["calls"])
    streams = [harness.make_stream(1, n_kv, group, dim, total, seed + r) for r in range(n_rows)]
    cursors = [0] * n_rows
    alone = [policy.init(**settings) for _ in range(n_rows)]  # each row fed by itself
    refs = [case.reference(**alone[0].settings) for _ in range(n_rows)]
    logs = [new_log(4) for _ in range(n_rows)]
    ended = [False] * n_rows

    rows = list(range(schedule["rows"]))  # stream index of each batch row
    state = batch.stack([alone[r] for r in rows], [logs[r] for r in rows])
    for t, (length, all_spans) in enumerate(schedule["calls"]):
        if t == schedule["drop_at"] and len(rows) > 1:
            drop = t % len(rows)
            state = state.keep([i for i in range(len(rows)) if i != drop])
            rows.pop(drop)
        if t == schedule["join_at"] and schedule["rows"] not in rows:
            state = state.concat(batch.stack([alone[schedule["rows"]]], [logs[schedule["rows"]]]))
            rows.append(schedule["rows"])
        if t == end_at and case.prompt_end is not None:
            state = batch.end_prompt(policy, state)
            for r in rows:
                alone[r] = policy.end_prompt(alone[r])
                refs[r].compress()
                ended[r] = True
                # a cut on a near tie (e.g. two prefix positions pooled over the same kernel
                # window) may round either way; the next call may feed this row nothing
                assume(refs[r].min_margin > harness.MIN_MARGIN)
        row_spans = [all_spans[r] for r in rows]
        k, v, q, chunks = padded_call(streams, cursors, rows, length, row_spans, n_kv, n_q, dim)
        step = batch.update(
            policy,
            state,
            mx.array(k),
            mx.array(v),
            mx.array(q),
            lengths=[c for _, c in row_spans],
            left_padding=[p for p, _ in row_spans],
        )
        out = np.array(batch.attend(mx.array(q), step, 1.0 / np.sqrt(dim)))
        state = step.state
        for i, (r, (pad, count)) in enumerate(zip(rows, row_spans, strict=True)):
            if count == 0:
                assert step.steps[i] is None
                np.testing.assert_array_equal(out[i], 0.0)
                continue
            ck, cv, cq = chunks[i]
            single = policy.update(alone[r], mx.array(ck), mx.array(cv), mx.array(cq))
            alone[r] = single.state
            want = harness.step_outputs(single, cq)
            np.testing.assert_allclose(out[i, :, pad : pad + count], want[0], rtol=1e-5, atol=1e-5)
            mask = np.ones(length, bool)
            mask[pad : pad + count] = False
            np.testing.assert_array_equal(out[i][:, mask], 0.0)
            ref_out, _ = refs[r].feed(ck, cv, cq, None)
            assume(refs[r].min_margin > harness.MIN_MARGIN)
            np.testing.assert_allclose(out[i : i + 1, :, pad : pad + count], ref_out, atol=1e-4)
        for i, r in enumerate(rows):
            row_state, _ = state.row(i)
            harness.assert_same_states(row_state, alone[r])
            if row_state.n_kept:
                harness.check_state(row_state, refs[r], cursors[r])
                if case.prompt_end is None:  # others grow until, and after, their cut
                    assert row_state.n_kept <= row_state.settings["budget"]
    assert state.tokens_kept == [alone[r].tokens_kept for r in rows]
    assert state.nbytes == sum(alone[r].nbytes for r in rows)


def test_stack_refuses_mixed_rows() -> None:
    tova = POLICIES["tova"]
    a = tova.init(budget=8, n_sink=1)
    with pytest.raises(ValueError, match="budget: 8 != 9"):
        batch.stack([a, tova.init(budget=9, n_sink=1)])
    with pytest.raises(ValueError, match="policy state"):
        batch.stack([a, POLICIES["h2o"].init(budget=8, n_sink=1)])
    fed = tova.update(a, mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    other = tova.update(a, mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    with pytest.raises(ValueError, match="H_kv: 2 != 1"):
        batch.stack([fed.state, other.state])
    two = tova.update(a, mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)), mx.zeros((2, 1, 3, 4)))
    with pytest.raises(ValueError, match="single-sequence"):
        batch.stack([two.state])
    with pytest.raises(ValueError, match="at least one"):
        batch.stack([])
    with pytest.raises(TypeError, match="PolicyState"):
        batch.stack([object()])


def test_row_keep_concat_errors_change_nothing() -> None:
    tova = POLICIES["tova"]
    both = batch.stack([tova.init(budget=8, n_sink=1), tova.init(budget=8, n_sink=1)])
    with pytest.raises(IndexError, match="row 2 out of range for a batch of 2"):
        both.row(2)
    with pytest.raises(IndexError):
        both.keep([0, 5])
    with pytest.raises(ValueError, match="budget"):
        both.concat(batch.stack([tova.init(budget=7, n_sink=1)]))
    assert both.batch_size == 2
    assert both.keep([1, 0, 1]).batch_size == 3


def test_update_refuses_bad_spans_and_keeps_the_batch() -> None:
    tova = POLICIES["tova"]
    both = batch.stack([tova.init(budget=8, n_sink=1), tova.init(budget=8, n_sink=1)])
    k = mx.zeros((2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"left_padding \(2\) and lengths \(2\)"):
        batch.update(tova, both, k, k, k, lengths=[1, 2], left_padding=[0, 2])
    with pytest.raises(ValueError, match=r"keys B \(1\) differs"):
        batch.update(tova, both, k[:1], k[:1], k[:1])
    with pytest.raises(ValueError, match="queries are required"):
        batch.update(tova, both, k, k, None, lengths=[0, 1])
    assert both.offsets == [0, 0] and both.tokens_kept == [0, 0]
