"""KVzip: compress a context once by how much reconstructing it attends to each pair (Kim et al.,
2025, https://arxiv.org/abs/2505.23416).

While the context streams in nothing is evicted (like SnapKV); the last probe row is
remembered. Compression then keeps, by score, ``budget`` rows per KV head on average: how they
are shared out is ``allocation`` (the vocabulary of :mod:`velox_cache_core.lanes`):

- ``"global"`` (the paper's and kvpress's default): one score threshold across every head of
  every layer; the mlx-lm orchestration (``velox_mlx_lm.compress``) finds it and gives each
  layer its row total (:func:`global_totals`); heads and layers keep different counts;
- ``"head"``: ``budget * H_kv`` rows per layer, shared out across its heads by score (AdaKV;
  kvpress's ``layerwise=True``);
- ``"uniform"``: exactly ``budget`` rows per head.

Every head keeps its ``n_sink`` sinks and at least ``allocation_floor`` of its uniform share.
With ``global``/``head`` the kept rows are held as lanes (:class:`~velox_cache_core.lanes.
Lanes`): no head is padded, so the layer holds its total and not ``H_kv`` times its fullest
head. The scores come from:

- ``probe="reconstruct"`` (KVzip): the caller feeds a reconstruction prompt (an instruction to
  repeat the context, then the context itself) in chunks and passes each chunk's queries to
  :func:`reconstruction_scores`: a context row's score is the largest attention weight any
  query of the chunk that repeats it gives it (max over the query heads of its KV group and over
  the chunk's queries; each chunk's softmax runs over the sinks, its own context rows and the
  chunk's own keys, causally). :func:`kvzip_compress` takes the concatenated scores. The
  policy's prompt end does nothing with this probe: compression waits for the scores.
- ``probe="latest"``: the last context query's weights, exactly TOVA's oneshot cut with scope
  ``head`` (its prompt end compresses by itself).

After compression, ``after="append"`` keeps every new token (like SnapKV: the questions and
answers grow the cache), ``after="tova"`` continues with TOVA's rule (scope ``head``,
sequential prefill) at ``budget``, which needs the uniform cut (and takes it by default).

Prompt caches saved before the allocation names changed (``"layer"``, and ``"head"`` for the
equal cut, with pad slots) load under the new names (:func:`upgrade_saved`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from math import gcd
from typing import Any, Literal

import mlx.core as mx

from velox_cache_core.allocation import shares
from velox_cache_core.attention_rule import SIGNALS, History, Rule, decide_by_weights, record_probes
from velox_cache_core.declarations import (
    Compressor,
    Scope,
    Signal,
    read_settings,
    running,
)
from velox_cache_core.engine import Call, Decision
from velox_cache_core.lanes import cut
from velox_cache_core.masks import chunk_causal
from velox_cache_core.policy import Policy
from velox_cache_core.scoring import decision_weights, grouped_logits, masked_softmax
from velox_cache_core.selection import highest_weights, sinks
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_budget_and_sinks, check_choice, check_scale

PROBES = ("reconstruct", "latest")
AFTERS = ("append", "tova")
Probe = Literal["reconstruct", "latest"]
After = Literal["append", "tova"]
Allocation = Literal["uniform", "head", "global"]
PAD = 2**30  # position of a pad slot in prompt caches saved before lanes (see upgrade_saved)


@dataclass(frozen=True, kw_only=True)
class KVzipState(shares.AllocationState):
    """KVzip layer state; ``compressed`` once the context has been cut to ``budget``."""

    budget: int
    n_sink: int
    probe: Probe
    signal: Signal
    after: After
    allocation: Allocation = "global"
    history: History | None = running()  # the last probe row (probe "latest")
    scale: float | None = running()
    compressed: bool = running(False)

    @property
    def scope(self) -> Scope:
        """What the engine reads for the mask layout: per KV head once TOVA decides."""
        return "head" if self.compressed and self.after == "tova" else "layer"

    @property
    def rule(self) -> Rule:
        """TOVA's rule that runs after compression with ``after="tova"``."""
        return Rule(self.budget, self.n_sink, self.signal, "head", "sequential", pins=self.pins)


def init_kvzip_state(
    budget: int = 512,
    n_sink: int = 4,
    probe: Probe = "reconstruct",
    signal: Signal = "query",
    after: After = "append",
    allocation: Allocation | None = None,
    allocation_floor: float = shares.FLOOR,
) -> KVzipState:
    """Empty KVzip state: ``0 <= n_sink < budget``; ``probe`` ``reconstruct`` or ``latest``;
    ``after`` ``append`` or ``tova``; ``allocation`` ``uniform``, ``head`` or ``global`` (how
    the reconstruction scores share the rows out; ``probe="latest"`` always cuts uniformly,
    like TOVA's oneshot cut; default ``global``, and ``uniform`` with ``after="tova"``, which
    continues with TOVA's per-head budget and needs it); ``0 <= allocation_floor <= 1``: a
    head's least share under ``head``/``global``, as a fraction of ``budget``."""
    check_budget_and_sinks(budget, n_sink)
    check_choice("after", after, AFTERS)
    if allocation is None:
        allocation = "uniform" if after == "tova" else "global"
    allocated = shares.allocation_fields(allocation, allocation_floor)
    if after == "tova" and allocation != "uniform":
        raise ValueError(
            f"after='tova' keeps exactly budget rows per KV head: it needs "
            f"allocation='uniform' (got allocation={allocation!r})"
        )
    return KVzipState(
        budget=budget,
        n_sink=n_sink,
        probe=check_choice("probe", probe, PROBES),  # type: ignore[arg-type]
        signal=check_choice("signal", signal, SIGNALS),  # type: ignore[arg-type]
        after=after,
        **allocated,
    )


def kvzip_rule(state: KVzipState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Before compression keep everything and remember the last probe row; after it append
    (``after="append"``) or evict by TOVA's rule (``after="tova"``)."""
    if state.compressed:
        if state.after == "tova":
            return decide_by_weights(state.rule, call, candidates)[0]
        return Decision(candidates)
    return record_probes(state, call, candidates, 1)


def _context(state: KVzipState) -> KVSlots:
    """The uncompressed context's slots: every position, in arrival order (slot i holds i)."""
    if not isinstance(state, KVzipState):
        raise TypeError(f"state must be a KVzipState, got {type(state).__name__}")
    if state.compressed:
        raise ValueError("the KVzip state is already compressed")
    if state.slots is None:
        raise ValueError("the KVzip state holds no context yet")
    return state.slots.compact()


def reconstruction_scores(
    state: KVzipState,
    queries: mx.array,
    keys: mx.array,
    start: int,
    end: int,
    scale: float | None = None,
) -> mx.array:
    """float32 ``[B, H_kv, end - start]``: the scores of context rows ``start..end-1`` from one
    reconstruction chunk (the chunk that repeats those rows).

    queries: ``[B, H_q, R, D]`` the chunk's queries; keys: ``[B, H_kv, R, D]`` its own keys
    (rotated at positions after the context). Each query's softmax runs over the
    ``min(n_sink, start)`` sinks, context rows ``start..end-1`` and the chunk's keys up to its
    own; a row's score is its largest weight over the query heads of its KV group and over the
    queries. Memory is ``O(R * (n_sink + (end - start) + R))`` per head, whatever the context.
    """
    live = _context(state)
    n = live.n_slots
    if not 0 <= start < end <= n:
        raise ValueError(f"need 0 <= start < end <= {n} (context rows), got {start}, {end}")
    scale = check_scale(scale, keys.shape[3])
    sink = min(state.n_sink, start)
    context = [rows.dense(live.keys[:, :, :sink]), rows.dense(live.keys[:, :, start:end])]
    scored = mx.concatenate([*context, keys.astype(live.keys.dtype)], axis=2)
    L = keys.shape[2]
    logits = grouped_logits(queries, scored, scale, "head")  # [B, H_kv, g, L, m]
    probs = masked_softmax(logits, chunk_causal(scored.shape[2] - L, L))
    return probs[..., sink : sink + end - start].max(axis=(2, 3))


def _protected(state: KVzipState, positions: mx.array) -> mx.array:
    return sinks(positions, state.n_sink, state.pins)


def global_totals(scores: list[mx.array], state: KVzipState) -> list[int]:
    """Rows each layer keeps under ``allocation="global"``: every head's floor, then one
    threshold over the other scores of every head of every layer (``scores``: one float
    ``[1, H_kv, n]`` per layer, the same ``n``, context rows in arrival order), so that the
    model keeps at most ``budget`` rows per head on average
    (:func:`velox_cache_core.allocation.shares.global_totals`). Batch size 1 only."""
    if not scores:
        raise ValueError("global_totals() needs the scores of at least one layer")
    n = int(scores[0].shape[2])
    width = shares.lane_width(state.budget)
    positions = [mx.broadcast_to(mx.arange(n, dtype=mx.int32), s.shape) for s in scores]
    protected = [_protected(state, p) for p in positions]
    least = shares.least_rows(state.budget, state.allocation_floor, protected)
    return shares.global_totals(scores, positions, protected, state.budget, least, width)


def _latest_weights(state: KVzipState, live: KVSlots) -> mx.array:
    """float32 ``[B, H_kv, n]``: the last context probe row's softmax over the context rows
    ``live``, averaged within each GQA group (TOVA's current-step weights, scope ``head``)."""
    assert state.history is not None and state.scale is not None
    logits = grouped_logits(state.history.probes, rows.dense(live.keys), state.scale, "head")
    return decision_weights(logits)[:, :, 0]


def kvzip_compress(
    state: KVzipState, scores: mx.array | None = None, total: int | None = None
) -> KVzipState:
    """Cut the context by ``scores`` (``[B, H_kv, n]``, one per context row in slot order):
    ``budget`` rows per KV head with ``allocation="uniform"`` (the sinks, then the highest
    scores, ties lost by the oldest); ``total`` rows across the layer's heads with
    ``head``/``global`` (default ``budget * H_kv``; under ``global``, what
    :func:`global_totals` gives the layer), held as lanes (:mod:`velox_cache_core.lanes`).
    Without ``scores`` (``probe="latest"`` only) the last probe row's weights decide, per head.
    A no-op on a compressed state."""
    if not isinstance(state, KVzipState):
        raise TypeError(f"state must be a KVzipState, got {type(state).__name__}")
    if state.compressed:
        return state
    done = replace(state, compressed=True, history=None)
    if scores is None and state.probe != "latest":
        raise ValueError("probe='reconstruct' needs the reconstruction scores")
    if state.slots is None:
        return done
    live = _context(state)
    B, H, n = live.positions.shape
    if scores is not None and tuple(scores.shape) != (B, H, n):
        raise ValueError(f"scores must be [B, H_kv, n] = {(B, H, n)}, got {tuple(scores.shape)}")
    if scores is not None and state.allocation != "uniform":
        if total is not None and total < 0:  # None: a layer alone, "global" over it is "head"
            raise ValueError(f"total must be >= 0, got {total}")
        if n <= state.budget:
            return done
        protected = _protected(state, live.positions)
        return shares.cut_into_lanes(done, live, scores.astype(mx.float32), protected, total)
    if n <= state.budget:
        return done
    if scores is None:
        scores = _latest_weights(state, live)
    positions = live.positions
    keep = highest_weights(scores, positions, _protected(state, positions), state.budget)
    return replace(done, slots=live.take(keep))


def kvzip_end_prompt(state: KVzipState) -> KVzipState:
    """End of the context: ``probe="latest"`` compresses now; ``reconstruct`` waits for the
    scores (:func:`kvzip_compress`), so the cache stays whole until then."""
    if state.compressed or state.probe != "latest":
        return state
    return kvzip_compress(state)


def _from_pads(state: KVzipState) -> KVzipState:
    """A state saved with pad slots (each head padded to the fullest with position
    :data:`PAD`) holding the same real rows as lanes."""
    if state.slots is None:
        return state
    live = state.slots.compact()
    real = live.positions < PAD
    counts: list[list[int]] = real.astype(mx.int32).sum(axis=-1).tolist()  # type: ignore[assignment]
    width = 0
    for c in (c for row in counts for c in row):
        width = gcd(width, c)
    lanes = cut(live, real.astype(mx.float32), mx.zeros_like(real), counts, max(width, 1))
    return replace(state, slots=KVSlots.empty_like(live.keys, live.values), lanes=lanes)


def upgrade_saved(meta: dict[str, Any]) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """Settings of a prompt cache saved before the allocation vocabulary changed (it has a
    ``padded`` field) under the new names: ``"head"`` (exactly budget per head) is now
    ``"uniform"``, ``"layer"`` (a layer's heads by score) is ``"head"``; pad slots become
    lanes (the second value: the fix to apply to the loaded state)."""
    if "padded" not in meta:
        return meta, None
    meta = dict(meta)
    padded = bool(meta.pop("padded"))
    old = meta.get("allocation", "global")
    meta["allocation"] = {"head": "uniform", "layer": "head"}.get(old, old)
    return meta, _from_pads if padded else None


def _check_whole(state: KVzipState) -> None:
    _context(state)


def _shares(scores: list[mx.array], state: KVzipState) -> list[int | None]:
    """One threshold over every layer for ``allocation="global"``; else each layer alone."""
    if state.allocation != "global":
        return [None] * len(scores)
    return list(global_totals(scores, state))


KVZIP = Policy(
    "kvzip",
    KVzipState,
    init_kvzip_state,
    kvzip_rule,
    prompt_end=kvzip_end_prompt,
    grows_after_prompt_end=True,
    traits=read_settings("signal", "budget", "scope", "n_sink"),
    upgrade=upgrade_saved,
    compressor=Compressor(
        needs_pass=lambda state: state.probe == "reconstruct",
        check=_check_whole,
        score=reconstruction_scores,
        cut=kvzip_compress,
        shares=_shares,
    ),
    summary={
        "kvzip": "compresses the document part of the prompt (all but its last line) once, "
        "by how much reconstructing it attends to each token, then answers (KVzip)",
    },
    help={
        "budget": "rows kept per KV head (on average, with allocation global or layer)",
        "probe": "what scores the context: a reconstruction pass, or its last query",
        "after": "after the cut, keep every new token (append) or evict by TOVA (tova)",
        "allocation": "how the rows are shared out: exactly budget per head (uniform), a "
        "layer's heads by score (head, AdaKV) or every layer's heads (global)",
        "allocation_floor": "a head's least share under head/global allocation, as a "
        "fraction of budget",
    },
)
kvzip_update = KVZIP.update
