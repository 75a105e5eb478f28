"""True queries and true positions: what the cache decides from is what the model computes.

The layer input is captured at each attention module; queries, keys and values are recomputed
from it by hand in numpy (projection, RoPE at the true position) and compared with what reaches
``tova_update``; evictions are recomputed from those with a float64 reference of
docs/architecture.md §3.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from velox_cache_core import Policy, fast_step
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig, TOVAKVCache


class Recorder:
    """Captures, in call order, each attention call's layer input and cache offset, and each
    ``tova_update`` call (arguments and result) and ``attend`` output."""

    def __init__(self, monkeypatch, model):
        # what is recorded is the general path's Policy.update; the decode fast path takes the
        # same decisions from the same queries bit for bit (test_fast_step.py), and is off here
        monkeypatch.setattr(fast_step, "ENABLED", False)
        self.layer_of = {id(layer.self_attn): i for i, layer in enumerate(model.layers)}
        self.inputs, self.updates, self.outputs = [], [], []
        attn_call = llama.Attention.__call__
        policy_update = Policy.update
        attend = TOVAKVCache.attend

        def record_attention(attn, x, mask=None, cache=None):
            self.inputs.append((self.layer_of[id(attn)], np.array(x), cache.offset))
            return attn_call(attn, x, mask, cache)

        def record_update(policy, state, keys, values, queries=None, scale=None, *args, **kw):
            step = policy_update(policy, state, keys, values, queries, scale, *args, **kw)
            self.updates.append((state, keys, values, queries, scale, step))
            return step

        def record_attend(cache, queries, scale, mask, sinks, **passed):
            out = attend(cache, queries, scale, mask, sinks, **passed)
            self.outputs.append(out)
            return out

        monkeypatch.setattr(llama.Attention, "__call__", record_attention)
        monkeypatch.setattr(Policy, "update", record_update)
        monkeypatch.setattr(TOVAKVCache, "attend", record_attend)


def _by_hand(h, attn, x, t0):
    """Queries, keys (RoPE at ``t0..``), values ``[H, L, D]`` from layer input ``x [1, L, d]``."""
    L = x.shape[1]
    D = attn.head_dim

    def project(linear, heads):
        y = x[0].astype(np.float64) @ np.array(linear.weight, dtype=np.float64).T
        return y.reshape(L, heads, D).transpose(1, 0, 2)

    base = attn.rope.base
    positions = np.arange(t0, t0 + L)
    q = h.rope_np(project(attn.q_proj, attn.n_heads), positions, base)
    k = h.rope_np(project(attn.k_proj, attn.n_kv_heads), positions, base)
    return q, k, project(attn.v_proj, attn.n_kv_heads)


CHUNKS = [20, 7, 1, 1, 1, 5, 1, 1, 3, 1, 1]


@pytest.mark.parametrize("signal", ["query", "key"])
@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_evictions_come_from_the_models_own_queries(
    monkeypatch, tiny_model, h, arch, scope, signal
):
    model = tiny_model(arch)
    budget, n_sink = 12, 2
    config = KVCacheConfig(
        tova_budget=budget, tova_n_sink=n_sink, tova_signal=signal, tova_scope=scope
    )
    cache = KVCacheBuilder.for_model(model, config)
    rec = Recorder(monkeypatch, model)
    h.forward_chunks(model, cache, h.random_tokens(sum(CHUNKS), seed=3), CHUNKS)

    n_layers = len(model.layers)
    assert len(rec.inputs) == len(rec.updates) == len(rec.outputs) == n_layers * len(CHUNKS)
    evictions = 0
    for (layer, x, t0), (state, keys, values, queries, scale, step), out in zip(
        rec.inputs, rec.updates, rec.outputs, strict=True
    ):
        attn = model.layers[layer].self_attn
        q, k, v = _by_hand(h, attn, x, t0)
        assert state.offset == t0  # the model rotated at the cache's true offset
        np.testing.assert_allclose(np.array(keys[0]), k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.array(values[0]), v, rtol=1e-4, atol=1e-5)
        if signal == "query" or keys.shape[2] > 1:  # chunks are decided in attend, with queries
            np.testing.assert_allclose(np.array(queries[0]), q, rtol=1e-4, atol=1e-5)
            assert scale == attn.scale
        else:
            assert queries is None
        # Evictions from a float64 recomputation with the hand-made probes.
        if state.slots is None:
            r_keys, r_pos = np.zeros((k.shape[0], 0, k.shape[2])), np.zeros((k.shape[0], 0))
            r_values = r_keys
        else:
            r_keys, r_pos = np.array(state.keys[0]), np.array(state.positions[0])
            r_values = np.array(state.values[0])
        probe = q if signal == "query" else k
        kept, weights = h.tova_reference(
            r_keys, r_pos, k, t0, probe, attn.scale, budget, n_sink, scope
        )
        got = [sorted(row) for row in np.array(step.state.positions[0]).tolist()]
        assert got == kept
        evictions += int(r_pos.shape[1] + k.shape[1] - len(kept[0]))
        # The attention the model computed used the same candidates and weights.
        if signal == "query":
            all_values = np.concatenate([r_values, v], axis=1)
            per_kv = attn.n_heads // attn.n_kv_heads
            want = np.stack([weights[i] @ all_values[i // per_kv] for i in range(attn.n_heads)])
            np.testing.assert_allclose(np.array(out[0]), want, rtol=1e-4, atol=1e-5)
    assert evictions >= n_layers * (sum(CHUNKS) - budget)


def test_queries_reach_the_hook_for_every_layer(monkeypatch, tiny_model, h):
    """Signal query never falls back to keys when the hook is installed (no warning, no
    ``tova_update`` call without queries)."""
    model = tiny_model("mistral")
    cache = KVCacheBuilder.for_model(model, KVCacheConfig(tova_budget=8, tova_n_sink=1))
    rec = Recorder(monkeypatch, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.forward_chunks(model, cache, h.random_tokens(30, seed=4), [11, 1, 1, 17])
    assert all(u[3] is not None for u in rec.updates)


@pytest.mark.parametrize("method", ["tova", "tova_adapted"])
def test_positions_and_rotation_stay_true_through_eviction(monkeypatch, tiny_model, h, method):
    model = tiny_model("mistral")
    budget, n_sink = 8, 2
    cache = KVCacheBuilder.for_model(
        model, KVCacheConfig(method=method, tova_budget=budget, tova_n_sink=n_sink)
    )
    rec = Recorder(monkeypatch, model)
    chunks = [13] + [1] * 90 + [9] + [1] * 20
    tokens = h.random_tokens(sum(chunks), seed=5)
    bank: list[dict[int, np.ndarray]] = [{} for _ in model.layers]  # hand keys by position
    seen = 0
    for size in chunks:
        start = len(rec.inputs)
        logits = model(tokens[:, seen : seen + size], cache=cache)
        mx.eval(logits)
        seen += size
        for layer, x, t0 in rec.inputs[start:]:
            assert t0 == seen - size
            _, k, _ = _by_hand(h, model.layers[layer].self_attn, x, t0)
            for i in range(size):
                bank[layer][t0 + i] = k[:, i]
        for layer, c in enumerate(cache):
            assert c.offset == seen
            assert c.size() == min(seen, budget)
            pos = np.array(c.positions[0])  # [H_kv, n_kept]
            keys = np.array(c.tova_state.keys[0])
            for hd in range(pos.shape[0]):
                row = pos[hd].tolist()
                assert len(set(row)) == len(row) and max(row) <= seen - 1
                assert set(range(min(n_sink, seen))) <= set(row)
                for j, p in enumerate(row):  # stored rotation is the one at the true position
                    np.testing.assert_allclose(keys[hd, j], bank[layer][p][hd], atol=2e-5)
    # The newest decode key was rotated at the true offset, not at the retained-row count.
    layer, x, t0 = rec.inputs[-1]
    attn = model.layers[layer].self_attn
    new_key = np.array(rec.updates[-1][1][0, :, 0])
    _, at_true, _ = _by_hand(h, attn, x, t0)
    _, at_kept, _ = _by_hand(h, attn, x, budget)
    np.testing.assert_allclose(new_key, at_true[:, 0], atol=2e-5)
    assert not np.allclose(new_key, at_kept[:, 0], atol=1e-3)
