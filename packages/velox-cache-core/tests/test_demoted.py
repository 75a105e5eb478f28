"""The demoted tier (velox_cache_core.demoted, store.tier) against a plain numpy reference.

For every call of a layer with a tier, the reference (float64, loops over batch rows and
heads) takes the call's candidates and mask as the engine laid them out, the tier's rows as
held before the call (dequantized), and the call's queries, and checks:

- the output is one softmax over visible candidates and tier rows, times their values;
- the rows the state stopped holding went into the tier, scored as the policy declares
  (the last query's weight, the weights summed, or the position), and the tier keeps its
  ``budget`` best;
- the main rows are exactly those of the same layer without a tier.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox_cache_core import POLICIES, Layer, Mode, TierSpec, new_log
from velox_cache_core.in_flight import STEPPED_CHUNK
from velox_cache_core.store.tier import Tier, keep_best


def _run(method, spec, calls, seed, B, H_q, H_kv, D, check=None, **settings_):
    policy = POLICIES[method]
    layer = Layer(policy, policy.init_for(method, **settings_), None, demote=spec)
    rng = np.random.default_rng(seed)
    outs = []
    for L in calls:
        k = mx.array(rng.standard_normal((B, H_kv, L, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((B, H_kv, L, D)).astype(np.float32))
        q = mx.array(rng.standard_normal((B, H_q, L, D)).astype(np.float32))
        before_state, before_tier = layer.state, layer.tier
        layer.lay_out(k, v)
        out = layer.attend(q, D**-0.5)
        outs.append(out)
        if check is not None:
            check(layer, before_state, before_tier, q, out)
    return layer, outs


def _rows(seed, B, H_q, H_kv, D, T):
    """Keys, values ``[B, H_kv, T, D]`` and queries ``[B, H_q, T, D]`` of a whole sequence."""
    rng = np.random.default_rng(seed)
    return (
        mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)),
        mx.array(rng.standard_normal((B, H_kv, T, D)).astype(np.float32)),
        mx.array(rng.standard_normal((B, H_q, T, D)).astype(np.float32)),
    )


def _feed(layer, rows, plan, start=0):
    """``layer`` fed ``rows`` in calls of ``plan`` tokens from token ``start``; the outputs."""
    k, v, q = rows
    D = int(k.shape[3])
    outs = []
    for L in plan:
        part = slice(start, start + L)
        layer.lay_out(k[:, :, part], v[:, :, part])
        outs.append(layer.attend(q[:, :, part], D**-0.5))
        start += L
    return outs


def _same_layers(a, b):
    """Bit for bit: the main rows, their positions, and the tier's rows, positions, scores."""
    sa, sb = a.state.slots.compact(), b.state.slots.compact()
    for x, y in zip(sa.arrays(), sb.arrays(), strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert (a.tier is None) == (b.tier is None)
    if a.tier is not None:
        for x, y in zip(a.tier.arrays(), b.tier.arrays(), strict=True):
            np.testing.assert_array_equal(np.array(x), np.array(y))


def _live(slots):
    live = slots.compact()
    return np.array(live.positions), np.array(live.keys)


def _reference_check(spec: TierSpec):
    def check(layer, before_state, before_tier, q, out):
        step = layer.last
        if step is None:  # a short chunk after the prompt ran as decode steps:
            assert 1 < q.shape[2] <= STEPPED_CHUNK  # test_a_short_chunk_is_decode_steps
            return
        assert step.positions is not None
        keys, values = np.array(step.keys, np.float64), np.array(step.values, np.float64)
        cand_pos = np.array(step.positions)
        B, H_kv, n, D = keys.shape
        H_q, L = q.shape[1], q.shape[2]
        g = H_q // H_kv
        qs = np.array(q, np.float64) * D**-0.5
        mask = None if step.mask is None else np.array(step.mask)
        if before_tier is not None:
            t_keys = np.array(before_tier.keys.dense(), np.float64)
            t_values = np.array(before_tier.values.dense(), np.float64)
            t_pos, t_scores = np.array(before_tier.positions), np.array(before_tier.scores)
        else:
            t_keys = np.zeros((B, H_kv, 0, D))
            t_values = np.zeros((B, H_kv, 0, D))
            t_pos, t_scores = np.zeros((B, H_kv, 0), int), np.zeros((B, H_kv, 0))
        T = t_keys.shape[2]
        expected = np.zeros((B, H_q, L, D))
        w_main = np.zeros((B, H_kv, L, n))
        w_tier = np.zeros((B, H_kv, L, T))
        for b in range(B):
            for h in range(H_q):
                kv = h // g
                for i in range(L):
                    logits = np.concatenate(
                        [keys[b, kv] @ qs[b, h, i], t_keys[b, kv] @ qs[b, h, i]]
                    )
                    if mask is not None:
                        m = mask[b if mask.shape[0] > 1 else 0]
                        row = m[h if m.shape[0] == H_q else (kv if m.shape[0] == H_kv else 0), i]
                        logits[:n] = np.where(row, logits[:n], -np.inf)
                    p = np.exp(logits - logits.max())
                    p /= p.sum()
                    expected[b, h, i] = p[:n] @ values[b, kv] + p[n:] @ t_values[b, kv]
                    w_main[b, kv, i] += p[:n] / g
                    w_tier[b, kv, i] += p[n:] / g
        np.testing.assert_allclose(np.array(out), expected, rtol=2e-4, atol=2e-4)

        def scored(w):
            return w.sum(axis=2) if spec.scoring == "accumulated" else w[:, :, -1]

        if spec.scoring == "recency":
            tier_scores = t_scores
        elif spec.scoring == "accumulated":
            tier_scores = t_scores + scored(w_tier)
        else:
            tier_scores = scored(w_tier)
        cand_scores = scored(w_main)
        # what went: the rows found, plus the new ones, less the rows kept
        start = before_state.offset
        after_pos, _ = _live(layer.state.slots)
        found = (
            np.zeros((B, H_kv, 0), int)
            if before_state.slots is None
            else _live(before_state.slots)[0]
        )
        for b in range(B):
            for h in range(H_kv):
                seen = list(found[b, h]) + list(range(start, start + L))
                gone = [p for p in seen if p not in set(after_pos[b, h])]
                rows = {
                    int(p): float(s) for p, s in zip(t_pos[b, h], tier_scores[b, h], strict=True)
                }
                for p in gone:
                    if spec.scoring == "recency":
                        rows[int(p)] = float(p)
                    else:
                        at = np.nonzero(cand_pos[b, h] == p)[0]
                        rows[int(p)] = float(cand_scores[b, h, at].sum())
                best = sorted(rows, key=lambda p: (-rows[p], -p))[: spec.budget]
                tier = layer.tier
                got = [] if tier is None else list(np.array(tier.positions)[b, h])
                assert sorted(got) == sorted(best), (b, h, got, best)
                if tier is not None:
                    got_scores = dict(zip(got, np.array(tier.scores)[b, h], strict=True))
                    for p in got:
                        assert got_scores[p] == pytest.approx(rows[p], rel=1e-3, abs=1e-6)

    return check


CASES = [
    ("tova", "weights", {}),
    ("h2o", "accumulated", {"recent": 4}),
    ("streaming_llm", "recency", {}),
    ("tova", "weights", {"scope": "head"}),
    ("h2o", "accumulated", {"recent": 3, "scope": "head", "prefill": "sequential"}),
]


@pytest.mark.parametrize(("method", "scoring", "extra"), CASES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(10, 20),
    tier_budget=st.integers(1, 24),
    bits=st.sampled_from([2, 4]),
    group=st.sampled_from([1, 2]),
    B=st.integers(1, 2),
    prompt=st.integers(1, 40),
    chunk=st.integers(2, 9),
    seed=st.integers(0, 2**16),
)
def test_tier_against_reference(
    method, scoring, extra, budget, tier_budget, bits, group, B, prompt, chunk, seed
):
    spec = TierSpec(bits, tier_budget, group_size=32, scoring=scoring)
    calls = [prompt, *[1] * 12, chunk, *[1] * 5, 17, 1]  # 17: a chunk checked as one
    H_kv = 2
    settings_ = {"budget": budget, "n_sink": 2, **extra}
    layer, outs = _run(
        method, spec, calls, seed, B, H_kv * group, H_kv, 32, _reference_check(spec), **settings_
    )
    assert layer.demote.scoring == scoring  # the policy's declaration
    plain, plain_outs = _run(method, None, calls, seed, B, H_kv * group, H_kv, 32, **settings_)
    # the main rows are the rows the same layer keeps without a tier
    got_pos, got_keys = _live(layer.state.slots)
    want_pos, want_keys = _live(plain.state.slots)
    for b in range(B):
        for h in range(H_kv):
            a, w = np.argsort(got_pos[b, h]), np.argsort(want_pos[b, h])
            np.testing.assert_array_equal(got_pos[b, h][a], want_pos[b, h][w])
            np.testing.assert_array_equal(got_keys[b, h][a], want_keys[b, h][w])
    # while nothing was demoted, the outputs are the plain layer's
    np.testing.assert_allclose(np.array(outs[0]), np.array(plain_outs[0]), rtol=1e-4, atol=1e-5)


def test_tier_keeps_every_evicted_row_when_it_has_room():
    spec = TierSpec(4, 1000, group_size=32)
    layer, _ = _run("tova", spec, [40, *[1] * 10, 7], 0, 1, 4, 2, 32, budget=16, n_sink=2)
    kept = set(_live(layer.state.slots)[0][0, 0].tolist())
    assert sorted(np.array(layer.tier.positions)[0, 0].tolist()) == sorted(set(range(57)) - kept)
    assert layer.tier.nbytes > 0
    # values per token at 4 bits: the dequantized rows are close to the rows demoted
    assert layer.tier.values.dense().shape == (1, 2, 57 - 16, 32)


def test_snapkv_prompt_end_demotes_its_cut():
    spec = TierSpec(2, 6, group_size=32)
    layer, _ = _run("snapkv", spec, [40, 1, 1], 3, 1, 4, 2, 32, budget=16, window=4)
    tier = np.array(layer.tier.positions)
    kept = _live(layer.state.slots)[0]
    for h in range(2):
        gone = sorted(set(range(40)) - set(kept[0, h].tolist()))
        assert sorted(tier[0, h].tolist()) == gone[-6:]  # unscored: the newest stay


def test_keep_best_prefers_newer_rows_on_ties():
    keys = mx.zeros((1, 1, 6, 32))
    from velox_cache_core.store.tier import demote

    spec = TierSpec(4, 3, group_size=32)
    positions = mx.array([[[5, 1, 9, 3, 7, 2]]], dtype=mx.int32)
    tier = demote(spec, None, keys, keys, positions, mx.zeros((1, 1, 6)))
    assert sorted(np.array(tier.positions)[0, 0].tolist()) == [5, 7, 9]
    scores = mx.array([[[0.5, 0.9, 0.1, 0.9, 0.2, 0.3]]])
    t = Tier(tier.keys, tier.values, tier.positions, mx.zeros((1, 1, 3)))
    assert t.n_rows == 3
    again = demote(spec, None, keys, keys, positions, scores)
    assert sorted(np.array(again.positions)[0, 0].tolist()) == [1, 3, 5]
    assert keep_best(again, 1).n_rows == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bits": 3, "budget": 4}, ValueError, "demote_bits must be one of 2, 4, got 3"),
        ({"bits": 2.0, "budget": 4}, TypeError, "demote_bits must be an int"),
        ({"bits": 2, "budget": 0}, ValueError, "demote_budget must be an int >= 1, got 0"),
        ({"bits": 2, "budget": 4, "group_size": 48}, ValueError, "kv_group_size"),
        ({"bits": 2, "budget": 4, "scoring": "mean"}, ValueError, "scoring must be one of"),
    ],
)
def test_spec_errors_name_the_setting(kwargs, error, match):
    with pytest.raises(error, match=match):
        TierSpec(**kwargs)


def test_layer_refusals():
    spec = TierSpec(2, 8)
    tova = POLICIES["tova"]
    with pytest.raises(ValueError, match="allocation='uniform'"):
        Layer(tova, tova.init(budget=16, scope="head", allocation="head"), None, demote=spec)
    streaming = POLICIES["streaming_llm"]
    with pytest.raises(ValueError, match="AT_ONCE"):
        Layer(streaming, streaming.init(budget=16), None, mode=Mode.AT_ONCE, demote=spec)
    with pytest.raises(TypeError, match="demote must be a TierSpec"):
        Layer(tova, tova.init(budget=16), None, demote=(2, 8))
    narrow = Layer(tova, tova.init(budget=16), None, demote=spec)
    rows = mx.zeros((1, 2, 3, 48))  # 48 features: no group of 64 divides them
    with pytest.raises(ValueError, match=r"must divide the values' width=48.*demote_bits=None"):
        narrow.lay_out(rows, rows)
    assert narrow.pending is None and narrow.state.slots is None  # nothing changed
    layer = Layer(tova, tova.init(budget=16), new_log(4), demote=spec)
    k = mx.zeros((1, 2, 3, 64))
    layer.lay_out(k, k)
    layer.attend(mx.zeros((1, 2, 3, 64)), 0.125)
    state = layer.state
    with pytest.raises(ValueError, match="cannot trim 4 tokens of a tova cache with a demoted"):
        layer.trim(4)  # within the last call only (3 tokens)
    assert layer.state is state
    # a call the queries never reached: the tier cannot be attended without them
    layer.lay_out(k[:, :, :1], k[:, :, :1])
    with pytest.raises(RuntimeError, match="demotes evicted rows into a tier"):
        layer.settle()


def _tier_examples(**more):
    """Every policy case, over budgets, tier budgets, widths, prompts and seeds (and ``more``),
    four examples each."""
    cases = pytest.mark.parametrize(("method", "scoring", "extra"), CASES)
    examples = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    drawn = given(
        budget=st.integers(10, 20),
        tier_budget=st.integers(1, 24),
        bits=st.sampled_from([2, 4]),
        prompt=st.integers(1, 40),
        seed=st.integers(0, 2**16),
        **more,
    )
    return lambda test: cases(examples(drawn(test)))


def _tier_layer(method, scoring, extra, budget, tier_budget, bits, log=None):
    spec = TierSpec(bits, tier_budget, group_size=32, scoring=scoring)
    policy = POLICIES[method]
    state = policy.init_for(method, budget=budget, n_sink=2, **extra)
    return Layer(policy, state, log, demote=spec)


@_tier_examples(chunk=st.integers(2, STEPPED_CHUNK))
def test_a_short_chunk_is_decode_steps(
    method, scoring, extra, budget, tier_budget, bits, prompt, chunk, seed
):
    """A chunk of at most ``STEPPED_CHUNK`` tokens after the prompt (a speculative verify
    chunk) gives the outputs, main rows and tier of the same tokens fed one by one."""
    rows = _rows(seed, 1, 4, 2, 32, prompt + 6 + chunk)
    layers = [_tier_layer(method, scoring, extra, budget, tier_budget, bits) for _ in "ab"]
    chunked = _feed(layers[0], rows, [prompt, *[1] * 6, chunk])
    stepped = _feed(layers[1], rows, [prompt, *[1] * 6, *[1] * chunk])
    np.testing.assert_array_equal(
        np.array(chunked[-1]), np.array(mx.concatenate(stepped[-chunk:], axis=2))
    )
    _same_layers(*layers)


@_tier_examples(last=st.integers(1, 24), data=st.data())
def test_a_trim_equals_a_layer_that_never_saw_the_tokens(
    method, scoring, extra, budget, tier_budget, bits, prompt, last, data, seed
):
    """Fed a last call of ``last`` tokens (as steps or as one chunk) then trimmed by ``n``:
    bit for bit the layer fed ``last - n`` tokens instead, and it goes on alike."""
    n = data.draw(st.integers(0, last), label="n")
    rows = _rows(seed, 1, 4, 2, 32, prompt + 6 + last + 3)
    head = [prompt, *[1] * 6]
    trimmed, fresh = (
        _tier_layer(method, scoring, extra, budget, tier_budget, bits, new_log(32)) for _ in "ab"
    )
    _feed(trimmed, rows, [*head, last])
    assert trimmed.trimmable_tokens == last
    trimmed.trim(n)
    _feed(fresh, rows, [*head, last - n] if last > n else head)
    _same_layers(trimmed, fresh)
    at = prompt + 6 + last - n
    a, b = _feed(trimmed, rows, [1, 2], at), _feed(fresh, rows, [1, 2], at)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    _same_layers(trimmed, fresh)
