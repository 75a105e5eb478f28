"""KVzip: compress a context once by how much reconstructing it attends to each pair (Kim et al.,
2025, https://arxiv.org/abs/2505.23416).

While the context streams in nothing is evicted (like SnapKV); the last probe row is
remembered. Compression then keeps, by score, ``budget`` rows per KV head on average: how they
are shared out is ``allocation``:

- ``"global"`` (the paper's and kvpress's default): one score threshold across every head of
  every layer; the mlx-lm orchestration (``velox_mlx_lm.kvzip.compress``) finds it and gives each
  layer its row total (:func:`global_totals`); heads and layers keep different counts;
- ``"layer"``: ``budget * H_kv`` rows per layer, shared out across its heads by score (kvpress's
  ``layerwise=True``);
- ``"head"``: exactly ``budget`` rows per head (uniform).

Every head keeps its ``n_sink`` sinks. With ``global``/``layer`` the slot store, which holds one
row count per layer, pads the heads that keep fewer rows than the layer's largest with *pad
slots* (position :data:`PAD`, zero keys and values) that every mask hides; ``nbytes`` counts
them (they are held), ``tokens_kept`` does not. The scores come from:

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
sequential prefill) at ``budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Literal

import mlx.core as mx

from velox_cache_core import rows as R
from velox_cache_core.attention_rule import History, Rule, decide_by_weights
from velox_cache_core.engine import Call, Decision
from velox_cache_core.masks import chunk_causal
from velox_cache_core.policies.tova import SIGNALS
from velox_cache_core.registry import Policy
from velox_cache_core.scoring import decision_weights, grouped_logits, masked_softmax
from velox_cache_core.selection import highest_weights, sinks
from velox_cache_core.sequential import row_visibility
from velox_cache_core.slots import KVSlots
from velox_cache_core.state import PolicyState, running
from velox_cache_core.traits import Compressor, Scope, Signal, read_settings
from velox_cache_core.validation import check_budget_and_sinks, check_choice, check_scale

PROBES = ("reconstruct", "latest")
AFTERS = ("append", "tova")
ALLOCATIONS = ("global", "layer", "head")
Probe = Literal["reconstruct", "latest"]
After = Literal["append", "tova"]
Allocation = Literal["global", "layer", "head"]
PAD = 2**30  # position of a pad slot: after every real position, so no query ever sees it


@dataclass(frozen=True, kw_only=True)
class KVzipState(PolicyState):
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
    padded: bool = running(False)  # pad slots present (heads keep different row counts)

    @property
    def scope(self) -> Scope:
        """What the engine reads for the mask layout: per KV head once TOVA decides or pad
        slots are held."""
        per_head = self.compressed and (self.after == "tova" or self.padded)
        return "head" if per_head else "layer"

    @property
    def tokens_kept(self) -> int:
        """Retained real rows per (batch row, KV head), averaged (pad slots left out)."""
        if not self.padded or self.slots is None:
            return self.n_kept
        B, H, _ = self.slots.positions.shape
        real = int((self.slots.positions < PAD).sum().item())  # type: ignore[arg-type]
        return real // (B * H)

    @property
    def rule(self) -> Rule:
        """TOVA's rule that runs after compression with ``after="tova"``."""
        return Rule(self.budget, self.n_sink, self.signal, "head", "sequential")


def init_kvzip_state(
    budget: int = 512,
    n_sink: int = 4,
    probe: Probe = "reconstruct",
    signal: Signal = "query",
    after: After = "append",
    allocation: Allocation = "global",
) -> KVzipState:
    """Empty KVzip state: ``0 <= n_sink < budget``; ``probe`` ``reconstruct`` or ``latest``;
    ``after`` ``append`` or ``tova``; ``allocation`` ``global``, ``layer`` or ``head`` (how the
    reconstruction scores share the rows out; ``probe="latest"`` always cuts per head, like
    TOVA's oneshot cut). ``after="tova"`` continues with TOVA's per-head budget, so it needs
    ``allocation="head"``."""
    check_budget_and_sinks(budget, n_sink)
    check_choice("allocation", allocation, ALLOCATIONS)
    check_choice("after", after, AFTERS)
    if after == "tova" and allocation != "head":
        raise ValueError(
            f"after='tova' keeps exactly budget rows per KV head: it needs allocation='head' "
            f"(got allocation={allocation!r})"
        )
    return KVzipState(
        budget=budget,
        n_sink=n_sink,
        probe=check_choice("probe", probe, PROBES),  # type: ignore[arg-type]
        signal=check_choice("signal", signal, SIGNALS),  # type: ignore[arg-type]
        after=after,
        allocation=allocation,
    )


def kvzip_rule(state: KVzipState, call: Call, slots: KVSlots, candidates: KVSlots) -> Decision:
    """Before compression keep everything and remember the last probe row; after it append
    (``after="append"``) or evict by TOVA's rule (``after="tova"``)."""
    if state.compressed:
        if state.after == "tova":
            return decide_by_weights(state.rule, call, candidates)[0]
        if state.padded:  # hide the pad slots: each query sees the positions up to its own
            return Decision(candidates, mask=row_visibility(candidates.positions, call.positions()))
        return Decision(candidates)
    probe = call.probe(state.signal)
    past = state.history or History(probe[:, :, :0], call.positions()[:0])
    history = past.extend(probe, call.positions(), 1)
    return Decision(candidates, changes={"history": history, "scale": call.scale})


def _context(state: KVzipState) -> KVSlots:
    """The uncompressed context's slots: every position, in arrival order (slot i holds i)."""
    if not isinstance(state, KVzipState):
        raise TypeError(f"state must be a KVzipState, got {type(state).__name__}")
    if state.compressed:
        raise ValueError("the KVzip state is already compressed")
    if state.slots is None:
        raise ValueError("the KVzip state holds no context yet")
    return state.slots.compact()


def latest_scores(state: KVzipState) -> mx.array:
    """float32 ``[B, H_kv, n]``: the last context probe row's softmax over the context,
    averaged within each GQA group (TOVA's current-step weights, scope ``head``)."""
    live = _context(state)
    assert state.history is not None and state.scale is not None
    logits = grouped_logits(state.history.probes, R.dense(live.keys), state.scale, "head")
    return decision_weights(logits)[:, :, 0]


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
    context = [R.dense(live.keys[:, :, :sink]), R.dense(live.keys[:, :, start:end])]
    scored = mx.concatenate([*context, keys.astype(live.keys.dtype)], axis=2)
    L = keys.shape[2]
    logits = grouped_logits(queries, scored, scale, "head")  # [B, H_kv, g, L, m]
    probs = masked_softmax(logits, chunk_causal(scored.shape[2] - L, L))
    return probs[..., sink : sink + end - start].max(axis=(2, 3))


def global_totals(scores: list[mx.array], budget: int, n_sink: int) -> list[int]:
    """Rows each layer keeps under ``allocation="global"``: one threshold over the non-sink
    scores of every head of every layer (``scores``: one float ``[1, H_kv, n]`` per layer, the
    same ``n``), so that ``budget - n_sink`` rows per head are kept on average; each layer's
    total counts its sinks. Ties at the threshold are all kept. Batch size 1 only."""
    if not scores:
        raise ValueError("global_totals() needs the scores of at least one layer")
    if any(s.ndim != 3 or s.shape[0] != 1 for s in scores):
        raise ValueError("global_totals() takes [1, H_kv, n] scores (one sequence)")
    n = scores[0].shape[2]
    sink = min(n_sink, n)
    rest = [s[..., sink:].astype(mx.float32) for s in scores]
    pool = mx.concatenate([r.reshape(-1) for r in rest])
    heads = sum(int(s.shape[1]) for s in scores)
    k = max(0, min(budget - n_sink, n - sink)) * heads
    if k == 0:
        return [sink * int(s.shape[1]) for s in scores]
    threshold = mx.sort(pool)[pool.shape[0] - k]
    counts: list[int] = mx.stack([(r >= threshold).sum() for r in rest]).tolist()  # type: ignore[assignment]
    return [c + sink * int(s.shape[1]) for c, s in zip(counts, scores, strict=True)]


def _shared_out(live: KVSlots, scores: mx.array, n_sink: int, total: int) -> tuple[KVSlots, bool]:
    """Keep ``total`` rows per batch row across all its KV heads (sinks first, then the
    highest ``scores``, ties lost by the oldest, then by the lower head); heads that keep fewer
    than the most get pad slots. Returns (slots, any pad slot)."""
    B, H, n = live.positions.shape
    total = min(total, H * n)
    positions = live.positions
    # One row of H * n candidates; the tie-break key orders by position, then head.
    age = positions * H + mx.arange(H, dtype=mx.int32)[None, :, None]
    flat = highest_weights(
        scores.reshape(B, 1, H * n),
        age.reshape(B, 1, H * n),
        sinks(positions, n_sink).reshape(B, 1, H * n),
        total,
    )[:, 0]
    keep = mx.zeros((B, H * n), dtype=mx.bool_)
    keep = mx.put_along_axis(keep, flat, mx.array(True), axis=-1).reshape(B, H, n)
    counts = keep.sum(axis=-1)
    cap = int(counts.max().item())  # type: ignore[arg-type]
    # Per head: the kept rows first (in slot order), then the others, which become pads.
    order = mx.argsort(mx.where(keep, 0, n) + mx.arange(n, dtype=mx.int32), axis=-1)[..., :cap]
    chosen = live.take(order)
    real = mx.arange(cap)[None, None, :] < counts[..., None]
    padded = bool((counts < cap).any().item())
    if not padded:
        return chosen, False
    return (
        KVSlots(
            keys=R.apply(chosen.keys, lambda a: mx.where(real[..., None], a, 0)),
            values=R.apply(chosen.values, lambda a: mx.where(real[..., None], a, 0)),
            positions=mx.where(real, chosen.positions, PAD).astype(mx.int32),
        ),
        True,
    )


def kvzip_compress(
    state: KVzipState, scores: mx.array | None = None, total: int | None = None
) -> KVzipState:
    """Cut the context by ``scores`` (``[B, H_kv, n]``, one per context row in slot order):
    ``budget`` rows per KV head with ``allocation="head"`` (the sinks, then the highest scores,
    ties lost by the oldest); ``total`` rows across the layer's heads with ``global``/``layer``
    (default ``budget * H_kv``; for ``global``, the ``total`` :func:`global_totals` gives the
    layer, or the default for a layer compressed alone), padded per head. Without ``scores``
    (``probe="latest"`` only) the last probe row's weights decide, per head. A no-op on a
    compressed state."""
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
    if scores is not None and state.allocation != "head":
        if total is None:  # a layer alone: "global" over this one layer is "layer"
            total = state.budget * H
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        slots, padded = _shared_out(live, scores.astype(mx.float32), state.n_sink, total)
        return replace(done, slots=slots, padded=padded)
    if n <= state.budget:
        return done
    if scores is None:
        scores = latest_scores(state)
    positions = live.positions
    keep = highest_weights(scores, positions, sinks(positions, state.n_sink), state.budget)
    return replace(done, slots=live.take(keep))


def kvzip_end_prompt(state: KVzipState) -> KVzipState:
    """End of the context: ``probe="latest"`` compresses now; ``reconstruct`` waits for the
    scores (:func:`kvzip_compress`), so the cache stays whole until then."""
    if state.compressed or state.probe != "latest":
        return state
    return kvzip_compress(state)


def _check_whole(state: KVzipState) -> None:
    _context(state)


def _needs_pass(state: KVzipState) -> bool:
    return state.probe == "reconstruct"


def _shares(scores: list[mx.array], state: KVzipState) -> list[int | None]:
    """One threshold over every layer for ``allocation="global"``; else each layer alone."""
    if state.allocation != "global":
        return [None] * len(scores)
    return list(global_totals(scores, state.budget, state.n_sink))


KVZIP = Policy(
    "kvzip",
    KVzipState,
    init_kvzip_state,
    kvzip_rule,
    prompt_end=kvzip_end_prompt,
    grows_after_prompt_end=True,
    traits=read_settings("signal", "budget", "scope", hides_rows=attrgetter("padded")),
    compressor=Compressor(
        needs_pass=_needs_pass,
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
        "allocation": "how the rows are shared out: over every layer's heads, each layer's, "
        "or exactly budget per head",
    },
)
kvzip_update = KVZIP.update
