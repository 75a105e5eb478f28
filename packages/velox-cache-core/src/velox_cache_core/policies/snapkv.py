"""SnapKV: compress the prompt once, by what its last queries attend to (Li et al., 2024,
https://arxiv.org/abs/2404.14469).

While the prompt streams in nothing is evicted; the last ``window`` probe rows are remembered.
``snapkv_compress`` then scores every earlier prompt token by the softmax of those rows
(summed over the rows, averaged within each GQA group), smooths the scores with
``avg_pool1d`` (``kernel``, zero padding, stride 1), and keeps the window plus the top scores up
to ``budget`` per KV head. Afterwards the cache grows: decode tokens are never evicted.

``allocation="head"`` (AdaKV) shares the layer's ``budget * H_kv`` rows across its heads by
the same scores instead (every head keeping its window), held as lanes so that the layer holds
no more bytes than the uniform cut; ``global`` shares every layer's rows, the last layer's
prompt end cutting them all (:mod:`velox_cache_core.allocation`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

import mlx.core as mx

from velox_cache_core.allocation import shares
from velox_cache_core.attention_rule import SIGNALS, History, record_probes
from velox_cache_core.declarations import Signal, read_settings, running
from velox_cache_core.engine import Call, Decision
from velox_cache_core.lanes import GlobalRule
from velox_cache_core.policy import Policy
from velox_cache_core.scoring import grouped_logits, masked_softmax
from velox_cache_core.selection import pinned
from velox_cache_core.sequential import row_visibility
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_choice, check_int


@dataclass(frozen=True, kw_only=True)
class SnapKVState(shares.AllocationState):
    """SnapKV layer state; ``compressed`` once the prompt has been cut to ``budget``."""

    budget: int
    window: int
    kernel: int
    signal: Signal
    history: History | None = running()
    scale: float | None = running()
    compressed: bool = running(False)


WINDOW = 32  # the paper's observation window, where the budget leaves room for it


def init_snapkv_state(
    budget: int = 512,
    window: int | None = None,
    kernel: int = 5,
    signal: Signal = "query",
    allocation: str = "uniform",
    allocation_floor: float = shares.FLOOR,
) -> SnapKVState:
    """Empty SnapKV state: ``1 <= window < budget`` (``None``: ``min(32, budget - 1)``, so a
    small budget needs no window of its own), odd ``kernel >= 1``; ``allocation``
    ``uniform``, ``head`` or ``global`` (see the module doc), ``0 <= allocation_floor <=
    1``."""
    allocated = shares.allocation_fields(allocation, allocation_floor)
    check_int("budget", budget, minimum=2)
    if window is None:
        window = min(WINDOW, budget - 1)
    check_int("window", window, minimum=1)
    if window >= budget:
        raise ValueError(f"window must be < budget ({budget}), got {window}")
    check_int("kernel", kernel, minimum=1)
    if kernel % 2 == 0:
        raise ValueError(f"kernel must be odd (avg_pool1d keeps length), got {kernel}")
    return SnapKVState(
        budget=budget,
        window=window,
        kernel=kernel,
        signal=check_choice("signal", signal, SIGNALS),  # type: ignore[arg-type]
        **allocated,
    )


def avg_pool1d(x: mx.array, kernel: int) -> mx.array:
    """Zero-padded moving average over the last axis (torch ``avg_pool1d``, stride 1,
    ``padding=kernel // 2``, ``count_include_pad=True``)."""
    if kernel == 1:
        return x
    pad = kernel // 2
    widths = [(0, 0)] * (x.ndim - 1) + [(pad, pad)]
    c = mx.cumsum(mx.pad(x, widths), axis=-1)
    c = mx.pad(c, [(0, 0)] * (x.ndim - 1) + [(1, 0)])
    return (c[..., kernel:] - c[..., :-kernel]) / kernel


def snapkv_rule(state: SnapKVState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Keep everything; until the prompt is compressed, remember the last probe rows."""
    if state.compressed:
        return Decision(candidates)
    return record_probes(state, call, candidates, state.window)


def _cut_scores(state: SnapKVState) -> tuple[KVSlots, mx.array, mx.array] | None:
    """The prompt's rows ``[B, H, n]``, their pooled scores (the window's and pinned rows'
    ``inf``) and the rows the cut keeps whatever their score (bool: the window, pins), or
    ``None`` when nothing is to cut (within budget, nothing fed)."""
    if state.slots is None or state.history is None or state.n_kept <= state.budget:
        return None
    live = state.slots.compact()
    n, W = live.n_slots, state.window
    history = state.history
    assert state.scale is not None
    logits = grouped_logits(
        history.probes, rows.dense(live.keys), state.scale, "head"
    )  # [B,H,G,w,n]
    visible = row_visibility(live.positions, history.positions)[:, :, None]
    probs = masked_softmax(logits, visible)
    scores = probs.sum(axis=3).mean(axis=2)  # [B, H_kv, n]
    # Prompt slots are in arrival order until the first cut: the last W are the window.
    scores = avg_pool1d(scores[..., : n - W], state.kernel)
    B, H = scores.shape[:2]
    window_rows = mx.broadcast_to(mx.arange(n) >= n - W, (B, H, n))
    full = mx.concatenate([scores, mx.full((B, H, W), mx.inf)], axis=-1)
    if state.pins is not None:
        pins = pinned(live.positions, state.pins)
        full, window_rows = mx.where(pins, mx.inf, full), window_rows | pins
    return live, full, window_rows


def _cut(state: SnapKVState, total: int | None) -> SnapKVState:
    """The prompt cut (``total``: the layer's rows under ``global``; ``None``: its own)."""
    done = replace(state, compressed=True, history=None)
    found = _cut_scores(state)
    if found is None:
        return done
    live, full, window_rows = found
    if state.allocation != "uniform":
        total = shares.linked_total(state, total, "snapkv")
        return shares.cut_into_lanes(done, live, full, window_rows, total)
    n, W = live.n_slots, state.window
    top = mx.argsort(-full[..., : n - W], axis=-1)[..., : state.budget - W]
    B, H = full.shape[:2]
    window = mx.broadcast_to(mx.arange(n - W, n), (B, H, W))
    keep = mx.sort(mx.concatenate([top, window], axis=-1), axis=-1)
    return replace(done, slots=live.take(keep.astype(mx.int32)))


def snapkv_compress(state: SnapKVState) -> SnapKVState:
    """End of the prompt: cut to ``budget`` per KV head (no-op if already compressed).
    ``global`` is cut by the model's linked layers together (see the module doc)."""
    if not isinstance(state, SnapKVState):
        raise TypeError(f"state must be a SnapKVState, got {type(state).__name__}")
    if state.compressed:
        return state
    return _cut(state, None)


SNAPKV = Policy(
    "snapkv",
    SnapKVState,
    init_snapkv_state,
    snapkv_rule,
    prompt_end=snapkv_compress,
    grows_after_prompt_end=True,
    appends_now=lambda state: state.compressed,
    traits=read_settings("signal", "budget", reserved=attrgetter("window")),
    global_rule=GlobalRule(
        pending=lambda state: not state.compressed,
        scores=_cut_scores,
        cut=_cut,
        spare=0,
        when="prompt_end",
    ),
    summary={
        "snapkv": "cuts the prompt once, at its end, by what its last tokens attend to (SnapKV)",
    },
    help={
        "budget": "tokens kept per KV head by the cut at the prompt's end",
        "window": "latest prompt queries whose attention decides the cut "
        f"(default: min({WINDOW}, budget - 1))",
        "kernel": "width of the moving average over the scores (odd)",
        "allocation": "how the cut shares the rows: budget per head (uniform), a layer's "
        "heads by score (head, AdaKV) or every head of every layer (global)",
        "allocation_floor": "a head's least share under head allocation, as a fraction of budget",
    },
)
snapkv_update = SNAPKV.update
