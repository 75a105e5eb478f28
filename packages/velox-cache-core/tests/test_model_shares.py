"""``allocation="global"`` for policies whose cut runs in one layer (SnapKV, Expected Attention,
TOVA, H2O): the layers linked by a ``ModelShares`` are cut together by one model-wide threshold.

SnapKV and TOVA are checked against a plain NumPy reference written from the definition (each
layer's scores in float64, every head's floor, one threshold over every other score of every
head of every layer, whole lanes, then each head's best rows of its share); the others for
what every global cut promises (the model's budget rows exactly, layers keeping different
counts, the bytes of the uniform cut), and the coordinator for its triggers, its refusals
(nothing changes when one fails) and copies."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from core_reference_lanes import order, ref_shares

from velox_cache_core import POLICIES
from velox_cache_core import lanes as LN
from velox_cache_core.allocation import shares as AS
from velox_cache_core.layer import Layer
from velox_cache_core.model_shares import ModelShares
from velox_cache_core.undo import UndoLog

L, H, G, D = 3, 2, 2, 8
SCALE = D**-0.5


def _stream(seed: int, n: int, batch: int = 1) -> list[tuple[mx.array, mx.array, mx.array]]:
    """Per layer: keys, values ``[B, H, n, D]``, queries ``[B, H * G, n, D]``; each layer's
    keys on its own scale, so the layers' scores differ."""
    rng = np.random.default_rng(seed)
    out = []
    for layer in range(L):
        k = rng.standard_normal((batch, H, n, D)) * (0.5 + layer)
        v = rng.standard_normal((batch, H, n, D))
        q = rng.standard_normal((batch, H * G, n, D)) * 1.5
        out.append(tuple(mx.array(a.astype(np.float32)) for a in (k, v, q)))
    return out  # type: ignore[return-value]


def _linked(name: str, **settings: Any) -> list[Layer]:
    policy = POLICIES[name]
    layers = [Layer(policy, policy.init(**settings), UndoLog(8)) for _ in range(L)]
    shares = ModelShares()
    for layer in layers:
        shares.join(layer)
    return layers


def _feed(layers: list[Layer], stream: list[Any], start: int, end: int) -> None:
    """One forward pass over positions ``start .. end - 1``, layer after layer."""
    for layer, (k, v, q) in zip(layers, stream, strict=True):
        layer.lay_out(k[:, :, start:end], v[:, :, start:end])
        layer.attend(q[:, :, start:end], SCALE)


def _kept(layer: Layer) -> list[list[int]]:
    rows = np.array(layer.state.positions)[0].tolist()
    return [sorted(p for p in head if p < LN.PAD) for head in rows]


# --------------------------------------------------------------------------- the reference


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _global_totals(scores, protected, budget, least, width):  # type: ignore[no-untyped-def]
    """Rows per layer: every head's ``least`` best (protected first), then the highest of all
    the other scores, ``budget`` per head on average; whole lanes, the rounding's spare lanes
    handed back by largest remainder."""
    n = scores[0].shape[-1]
    cap = width * (n // width)
    floor = min(least, cap)
    pool = []
    for i, (s, prot) in enumerate(zip(scores, protected, strict=True)):
        for h in range(H):
            ranked = order(s[h], np.arange(n), prot[h])
            pool += [(np.inf if prot[h, p] else s[h, p], i) for p in ranked[floor:]]
    pool.sort(key=lambda t: -t[0])
    raw = [floor * H] * len(scores)
    for _, i in pool[: budget * H * len(scores) - floor * H * len(scores)]:
        raw[i] += 1
    totals = [width * (r // width) for r in raw]
    spare = sum(raw) - sum(totals)
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] % width), i))[: spare // width]:
        totals[i] += width
    return totals


def _reference_cut(scores, protected, budget, least, width):  # type: ignore[no-untyped-def]
    """Kept positions per layer and head after the global cut."""
    totals = _global_totals(scores, protected, budget, least, width)
    n = scores[0].shape[-1]
    positions = np.broadcast_to(np.arange(n), (1, H, n))
    out = []
    for s, prot, total in zip(scores, protected, totals, strict=True):
        counts = ref_shares(s[None], positions, prot[None], total, least, width)[0]
        out.append([sorted(order(s[h], np.arange(n), prot[h])[: counts[h]]) for h in range(H)])
    return out, totals


def _snapkv_scores(k: np.ndarray, q: np.ndarray, n: int, window: int, kernel: int) -> np.ndarray:
    """SnapKV's pooled scores ``[H, n]`` of one layer (float64), the window's ``inf``."""
    out = np.zeros((H, n))
    for h in range(H):
        for qh in range(h * G, (h + 1) * G):
            for t in range(n - window, n):
                out[h, : t + 1] += _softmax(k[h, : t + 1] @ q[qh, t] * SCALE) / G
    pad = kernel // 2
    padded = np.pad(out[:, : n - window], ((0, 0), (pad, pad)))
    pooled = np.stack([padded[:, i : i + kernel].mean(axis=1) for i in range(n - window)], axis=1)
    return np.concatenate([pooled, np.full((H, window), np.inf)], axis=1)


# --------------------------------------------------------------------------- the policies


@pytest.mark.parametrize("seed", range(4))
def test_snapkv_global_matches_reference(seed: int) -> None:
    n, budget, window, kernel, floor = 48, 16, 4, 3, 0.2
    stream = _stream(seed, n)
    layers = _linked("snapkv", budget=budget, window=window, kernel=kernel, allocation="global")
    _feed(layers, stream, 0, n - 1)
    _feed(layers[:-1], stream[:-1], n - 1, n)  # the prompt's last token, all but the last layer
    assert all(layer.state.lanes is None for layer in layers)  # arrived, not cut yet
    _feed(layers[-1:], stream[-1:], n - 1, n)  # the last layer arrives: every layer is cut
    scores = [
        _snapkv_scores(np.array(k[0], np.float64), np.array(q[0], np.float64), n, window, kernel)
        for k, _, q in stream
    ]
    protected = [np.broadcast_to(np.arange(n) >= n - window, (H, n)) for _ in range(L)]
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, window, width)
    want, totals = _reference_cut(scores, protected, budget, least, width)
    assert [_kept(layer) for layer in layers] == want
    assert sum(totals) == budget * H * L and len(set(totals)) > 1


@pytest.mark.parametrize("seed", range(4))
def test_tova_global_matches_reference(seed: int) -> None:
    n, budget, n_sink, floor = 40, 16, 2, 0.2
    stream = _stream(seed, n)
    layers = _linked("tova", budget=budget, n_sink=n_sink, scope="head", allocation="global")
    _feed(layers, stream, 0, n - 1)  # held whole
    assert all(layer.state.holds_prompt for layer in layers)
    k0, v0, _ = stream[0]
    layers[0].lay_out(k0[:, :, n - 1 :], v0[:, :, n - 1 :])  # the first token: every layer cut
    m = n - 1
    scores = []
    for k, _, q in stream:
        kk, qq = np.array(k[0], np.float64), np.array(q[0], np.float64)
        w = np.zeros((H, m))
        for h in range(H):
            for qh in range(h * G, (h + 1) * G):
                w[h] += _softmax(kk[h, :m] @ qq[qh, m - 1] * SCALE) / G
        scores.append(w)
    protected = [np.broadcast_to(np.arange(m) < n_sink, (H, m)) for _ in range(L)]
    width = AS.lane_width(budget)
    least = AS.floor_rows(budget, floor, n_sink + 2, width)
    want, totals = _reference_cut(scores, protected, budget, least, width)
    for i, layer in enumerate(layers):
        got = _kept(layer)
        for h in range(H):  # every head's weakest unprotected row is its dead row
            evictable = [p for p in want[i][h] if p >= n_sink]
            dead = min(evictable, key=lambda p, i=i, h=h: (scores[i][h, p], p))
            assert got[h] == [p for p in want[i][h] if p != dead], (i, h)
    assert sum(totals) == budget * H * L and len(set(totals)) > 1
    # decoding goes on within every layer's shares
    layers[0].attend(stream[0][2][:, :, n - 1 :], SCALE)
    _feed(layers[1:], stream[1:], n - 1, n)
    assert [sum(len(h) for h in _kept(layer)) for layer in layers] == [t - H for t in totals]


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("h2o", {"budget": 16, "n_sink": 2, "recent": 2, "scope": "head"}),
        ("expected_attention", {"budget": 16, "n_sink": 2, "recent": 2, "rope_base": 1e4}),
    ],
)
def test_global_cut_keeps_the_models_budget(name: str, settings: dict[str, Any]) -> None:
    n = 48
    stream = _stream(7, n + 6)
    layers = _linked(name, allocation="global", **settings)
    uniform = _linked(name, **settings)
    for group in (layers, uniform):
        _feed(group, stream, 0, n)
        for layer in group:
            layer.end_prompt()  # Expected Attention's prompt end (H2O: none)
        for t in range(n, n + 6):  # H2O's cut comes with the first single token
            _feed(group, stream, t, t + 1)
    held = [layer.state.lanes.n_lanes * layer.state.lanes.width for layer in layers]
    assert sum(held) == settings["budget"] * H * L  # dead rows included
    assert len(set(held)) > 1  # the layers keep different counts
    assert sum(layer.state.nbytes for layer in layers) <= sum(
        layer.state.nbytes for layer in uniform
    )
    assert all(layer.offset == n + 6 for layer in layers)


# --------------------------------------------------------------------------- the coordinator


def test_an_unlinked_layer_is_refused_and_left_as_it_was() -> None:
    policy = POLICIES["tova"]
    layer = Layer(policy, policy.init(budget=8, scope="head", allocation="global"), None)
    k, v, q = _stream(0, 20)[0]
    layer.lay_out(k[:, :, :19], v[:, :, :19])
    layer.attend(q[:, :, :19], SCALE)
    before = layer.state
    with pytest.raises(ValueError, match="not linked to the others"):
        layer.lay_out(k[:, :, 19:], v[:, :, 19:])
    assert layer.state is before


def test_a_batch_is_refused_and_no_layer_changes() -> None:
    layers = _linked("tova", budget=8, scope="head", allocation="global")
    stream = _stream(1, 20, batch=2)
    _feed(layers, stream, 0, 19)
    before = [layer.state for layer in layers]
    k, v, _ = stream[0]
    with pytest.raises(ValueError, match="one sequence"):
        layers[0].lay_out(k[:, :, 19:], v[:, :, 19:])
    assert all(layer.state is state for layer, state in zip(layers, before, strict=True))


def test_a_prompt_within_budget_is_not_cut() -> None:
    layers = _linked("tova", budget=32, scope="head", allocation="global")
    stream = _stream(2, 20)
    _feed(layers, stream, 0, 19)
    _feed(layers, stream, 19, 20)
    assert all(layer.state.lanes is None and not layer.state.holds_prompt for layer in layers)


def test_a_copy_of_the_layers_links_the_copies() -> None:
    layers = _linked("snapkv", budget=8, window=2, allocation="global")
    stream = _stream(3, 30)
    _feed(layers, stream, 0, 29)
    copies = copy.deepcopy(layers)
    assert copies[0].shares is not layers[0].shares
    assert all(c.shares is copies[0].shares for c in copies)
    assert all(a is b for a, b in zip(copies[0].shares.layers, copies, strict=True))
    _feed(copies, stream, 29, 30)  # the copies cut themselves, the originals stay whole
    assert all(c.state.lanes is not None for c in copies)
    assert all(layer.state.lanes is None for layer in layers)


def test_join_refuses_a_policy_without_a_global_rule() -> None:
    policy = POLICIES["streaming_llm"]
    with pytest.raises(ValueError, match="no global allocation rule"):
        ModelShares().join(Layer(policy, policy.init(), None))
