"""Expected Attention: keep the keys that future queries are expected to attend to (Devoto et
al., 2025, https://arxiv.org/abs/2510.00636; kvpress's ``ExpectedAttentionPress``).

The recent queries are modelled as a Gaussian: their mean ``mu`` and per-head covariance
``Sigma``, taken from the last ``n_queries`` queries (positions ``< n_sink`` left out) in
their un-rotated form, then turned by the RoPE rotation averaged over the next ``n_future``
positions. For a query ``q ~ N(mu, Sigma)``, ``E[exp(s q.k)] = exp(s mu.k + s^2 k'Sigma k / 2)``
(``s`` the softmax scale; with ``s = 1/sqrt(d)`` the logit is ``mu.k/sqrt(d) + k'Sigma k/(2d)``).
A key's score is that logit's softmax over the non-sink keys, averaged over its GQA group, times
``||v||`` (``use_vnorm``: ``(p + epsilon) * ||v||``). Sinks are never evicted, nor, after the
prompt's cut, the ``recent`` newest tokens.

While the prompt streams in nothing is evicted (like SnapKV) and the last ``n_queries`` queries
are kept, un-rotated with their own positions (the attention hook hands over the queries after
RoPE; ``rope_*`` say how the model rotated them, and ``KVCacheBuilder.for_model`` fills them in).
At the prompt's end the statistics are computed, every key is scored and each KV head is cut to
``budget`` (sinks first, then the highest scores, ties lost by the oldest). Each later token's
key is scored on arrival with the current statistics (the softmax normalizer of the last
scoring), and the lowest-scored candidate that is neither a sink nor among the ``recent`` newest
goes (a new key scores low against statistics of older queries: without that window a small
budget evicts the tokens just generated); every ``refresh_every`` tokens the
statistics are recomputed from the last ``n_queries`` queries and every kept key re-scored. A
chunk after the prompt's end attends causally and is then cut once by the scores (its ``recent``
newest kept). The scores are a running array aligned with the slots.

``allocation="head"`` (AdaKV): the prompt's cut shares the layer's ``budget * H_kv`` rows
across its heads by the same scores (every head keeping its sinks, its ``recent`` newest and
at least ``allocation_floor`` of its uniform share), held as lanes with one dead row per head
(:mod:`velox_cache_core.lanes`); every later token goes into its head's dead row, is scored on
arrival, and each head's lowest evictable row becomes the next dead row. The statistics are
refreshed every ``refresh_every`` tokens as before, every held row re-scored, the softmax
normalised per head across its lanes (a chunk over lanes runs token by token; its refresh, when
due, comes with its first token). ``global`` shares every layer's rows, the last layer's
prompt end cutting them all (:mod:`velox_cache_core.allocation`); decode runs as under ``head``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import mlx.core as mx

from velox_cache_core.allocation import shares
from velox_cache_core.attention_rule import History, align_scores, protect_recent
from velox_cache_core.declarations import Traits, running
from velox_cache_core.engine import Call, Decision
from velox_cache_core.lanes import GlobalRule
from velox_cache_core.policies.expected_lanes import EA_LANES
from velox_cache_core.policies.expected_scores import (
    QueryStats,
    RoPE,
    arrival_scores,
    expected_logits,
    log_normalizer,
    remember,
    scores_from_logits,
    window_stats,
)
from velox_cache_core.policy import Policy
from velox_cache_core.selection import highest_weights, lowest_weight, sinks
from velox_cache_core.store import rows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.validation import check_bool, check_budget_and_sinks, check_int


@dataclass(frozen=True, kw_only=True)
class ExpectedAttentionState(shares.AllocationState):
    """Expected Attention layer state; ``compressed`` once the prompt has been cut.

    queries: the last ``n_queries`` queries, un-rotated (``probes`` ``[B, H_q, w, D]``);
    mean/cov: the statistics in use (:class:`QueryStats`); log_norm ``[B, H_q]``: the softmax
    normalizer of the last scoring; scores float32 ``[B, H_kv, S]``: slot-aligned; steps:
    tokens since the statistics were last computed.
    """

    budget: int
    n_sink: int
    recent: int
    n_queries: int
    refresh_every: int
    n_future: int
    use_covariance: bool
    use_vnorm: bool
    epsilon: float
    rope_base: float | None
    rope_dims: int | None
    rope_traditional: bool
    rope_scale: float
    queries: History | None = running()
    mean: mx.array | None = running()
    cov: mx.array | None = running()
    log_norm: mx.array | None = running()
    scores: mx.array | None = running()
    scale: float | None = running()
    steps: int = running(0)
    compressed: bool = running(False)
    # over lanes: the position whose step refreshed the statistics (``scores`` then holds the
    # lanes' fresh scores, ``[B, N, W]``), None otherwise
    refreshed_at: int | None = running()

    protect = protect_recent

    def rope(self, head_dim: int) -> RoPE:
        """The model's RoPE for heads of ``head_dim`` features; ``ValueError`` when it was
        never given (a cache made without ``KVCacheBuilder.for_model``)."""
        dims = head_dim if self.rope_dims is None else self.rope_dims
        if dims > head_dim or dims % 2:
            raise ValueError(
                f"rope_dims ({dims}) must be even and at most the head dimension ({head_dim})"
            )
        if dims and self.rope_base is None:
            raise ValueError(
                "expected_attention needs the model's RoPE to un-rotate its queries: set "
                "rope_base (and rope_dims, rope_traditional, rope_scale), or build the caches "
                "with velox_mlx_lm's KVCacheBuilder.for_model, which reads them off the model "
                "(rope_dims=0: the model has no RoPE)"
            )
        return RoPE(self.rope_base or 1.0, dims, self.rope_traditional, self.rope_scale)

    @property
    def stats(self) -> QueryStats:
        assert self.mean is not None
        return QueryStats(self.mean, self.cov)


def _check_float(name: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    """``value`` must be a finite int or float ``>= minimum`` (``> minimum`` when ``strict``)."""
    kind = f"a finite float {'>' if strict else '>='} {minimum}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {kind}, got {value}")
    return float(value)


RECENT = 16  # the default recent window, when the budget has room for it


def init_expected_attention_state(
    budget: int = 512,
    n_sink: int = 4,
    recent: int | None = None,
    n_queries: int = 128,
    refresh_every: int = 64,
    n_future: int = 512,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
    rope_base: float | None = None,
    rope_dims: int | None = None,
    rope_traditional: bool = False,
    rope_scale: float = 1.0,
    allocation: str = "uniform",
    allocation_floor: float = shares.FLOOR,
) -> ExpectedAttentionState:
    """Empty Expected Attention state: ``0 <= n_sink < budget``; ``0 <= recent < budget -
    n_sink`` (``None``: 16, or ``budget - n_sink - 1`` when that is smaller); ``n_queries``,
    ``refresh_every``, ``n_future >= 1``; ``epsilon >= 0``; ``rope_base > 1`` (``None``: not
    known yet), ``rope_dims`` even ``>= 0`` (``None``: the whole head; 0: no RoPE),
    ``rope_scale > 0``; ``allocation`` ``uniform``, ``head`` or ``global`` (see the module
    doc), ``0 <= allocation_floor <= 1``."""
    check_budget_and_sinks(budget, n_sink)
    allocated = shares.allocation_fields(allocation, allocation_floor)
    recent = min(RECENT, budget - n_sink - 1) if recent is None else recent
    check_int("recent", recent, minimum=0)
    if recent >= budget - n_sink:
        raise ValueError(
            f"recent must be an int >= 0 and < budget - n_sink ({budget - n_sink}) so a scored "
            f"token is kept, got {recent}"
        )
    check_int("n_queries", n_queries, minimum=1)
    check_int("refresh_every", refresh_every, minimum=1)
    check_int("n_future", n_future, minimum=1)
    check_bool("use_covariance", use_covariance)
    check_bool("use_vnorm", use_vnorm)
    epsilon = _check_float("epsilon", epsilon, minimum=0.0)
    if rope_base is not None:
        rope_base = _check_float("rope_base", rope_base, minimum=1.0, strict=True)
    if rope_dims is not None:
        check_int("rope_dims", rope_dims, minimum=0)
        if rope_dims % 2:
            raise ValueError(f"rope_dims must be even (features turn in pairs), got {rope_dims}")
    check_bool("rope_traditional", rope_traditional)
    rope_scale = _check_float("rope_scale", rope_scale, minimum=0.0, strict=True)
    return ExpectedAttentionState(
        budget=budget,
        n_sink=n_sink,
        recent=recent,
        n_queries=n_queries,
        refresh_every=refresh_every,
        n_future=n_future,
        use_covariance=use_covariance,
        use_vnorm=use_vnorm,
        epsilon=epsilon,
        rope_base=rope_base,
        rope_dims=rope_dims,
        rope_traditional=rope_traditional,
        rope_scale=rope_scale,
        **allocated,
    )


def _rescore(
    state: ExpectedAttentionState, window: History, slots: KVSlots, *, offset: int, scale: float
) -> dict[str, Any]:
    """Fresh statistics from ``window`` (the future starting at ``offset``) and every slot
    re-scored with them: the running fields that change."""
    keys = rows.dense(slots.keys)
    stats = window_stats(state, window, int(keys.shape[3]), offset)
    logits = expected_logits(stats, keys, scale)
    log_norm = log_normalizer(logits, ~sinks(slots.positions, state.n_sink))
    scores = scores_from_logits(
        logits, log_norm, slots.values, use_vnorm=state.use_vnorm, epsilon=state.epsilon
    )
    B = int(keys.shape[0])
    return {
        "mean": stats.mean,
        "cov": stats.cov,
        "log_norm": log_norm.reshape(B, -1),
        "scores": scores,
        "steps": 0,
    }


def _scores_with_new(
    state: ExpectedAttentionState, call: Call, slots: KVSlots, candidates: KVSlots
) -> mx.array:
    """float32 ``[B, H_kv, n]`` aligned with ``candidates``: the kept scores, and the call's
    keys scored with the current statistics and the last scoring's normalizer."""
    assert state.scores is not None and state.log_norm is not None
    _, H, L, _ = call.shape
    fresh = arrival_scores(state, call.keys, call.values, call.scale)
    kept = align_scores(state.scores, slots, H, L)
    if L == 1:  # the new token sits in the dead slot or after the live ones
        return mx.where(candidates.positions == call.newest(), fresh, kept)
    return mx.concatenate([kept[..., :-L], fresh], axis=-1)


def _evict(
    state: ExpectedAttentionState, call: Call, candidates: KVSlots, scores: mx.array
) -> tuple[KVSlots, mx.array]:
    """(kept slots, their scores): over budget, one token frees the lowest-scored slot that is
    neither a sink nor among the ``recent`` newest; a chunk keeps those and the highest scores."""
    if candidates.n_slots <= state.budget:
        return candidates, scores
    positions = candidates.positions
    protected = state.protect(positions, call.newest())
    if call.length == 1:
        return candidates.with_free(lowest_weight(scores, positions, protected)), scores
    keep = highest_weights(scores, positions, protected, state.budget)
    return candidates.take(keep), mx.take_along_axis(scores, keep, axis=-1)


def expected_attention_rule(
    state: ExpectedAttentionState, call: Call, slots: KVSlots, candidates: KVSlots
) -> Decision:
    """Before the prompt's end keep everything and remember the queries; after it score the new
    keys and evict the lowest (one token) or cut to ``budget`` (a chunk), re-scoring every
    candidate with fresh statistics every ``refresh_every`` tokens."""
    window = remember(state, call)
    if not state.compressed:
        return Decision(candidates, changes={"queries": window, "scale": call.scale})
    steps = state.steps + call.length
    changes: dict[str, Any] = {"queries": window, "scale": call.scale, "steps": steps}
    if state.mean is None or steps >= state.refresh_every:  # (mean: a prompt cut while empty)
        end = call.start + call.length
        changes.update(_rescore(state, window, candidates, offset=end, scale=call.scale))
        scores = changes["scores"]
    else:
        scores = _scores_with_new(state, call, slots, candidates)
    kept, changes["scores"] = _evict(state, call, candidates, scores)
    return Decision(kept, changes=changes)


def expected_attention_compress(state: ExpectedAttentionState) -> ExpectedAttentionState:
    """End of the prompt: statistics of its last queries, every key scored, each KV head cut to
    ``budget`` (a no-op once compressed)."""
    if not isinstance(state, ExpectedAttentionState):
        raise TypeError(f"state must be an ExpectedAttentionState, got {type(state).__name__}")
    if state.compressed:
        return state
    return _cut(state, None)


def _prompt(state: ExpectedAttentionState) -> tuple[KVSlots, dict[str, Any]] | None:
    """The prompt's rows and what re-scoring them changes (:func:`_rescore`), or ``None`` when
    nothing was fed."""
    if state.slots is None or state.queries is None:
        return None
    assert state.scale is not None
    live = state.slots.compact()
    return live, _rescore(state, state.queries, live, offset=state.offset, scale=state.scale)


def _cut_scores(state: ExpectedAttentionState) -> tuple[KVSlots, mx.array, mx.array] | None:
    """The prompt's rows, their expected scores and the rows the cut spares (sinks, the
    ``recent`` newest), or ``None`` when nothing is to cut."""
    found = None if state.n_kept <= state.budget else _prompt(state)
    if found is None:
        return None
    live, changes = found
    return live, changes["scores"], state.protect(live.positions, state.offset - 1)


def _cut(state: ExpectedAttentionState, total: int | None) -> ExpectedAttentionState:
    """The prompt's cut (``total``: the layer's rows under ``global``; ``None``: its own)."""
    done = replace(state, compressed=True)
    found = _prompt(state)
    if found is None:
        return done
    live, changes = found
    scores = changes.pop("scores")
    if live.n_slots > state.budget and state.allocation != "uniform":
        newest = state.offset - 1
        return shares.cut_evicting(
            done,
            live,
            scores,
            lambda positions: state.protect(positions, newest),
            name="expected_attention",
            keep_scores=True,
            total=total,
            scores=None,
            **changes,
        )
    if live.n_slots > state.budget:
        positions = live.positions
        keep = highest_weights(
            scores, positions, sinks(positions, state.n_sink, state.pins), state.budget
        )
        live = live.take(keep)
        scores = mx.take_along_axis(scores, keep, axis=-1)
    return replace(done, slots=live, scores=scores, **changes)


EXPECTED_ATTENTION = Policy(
    "expected_attention",
    ExpectedAttentionState,
    init_expected_attention_state,
    expected_attention_rule,
    prompt_end=expected_attention_compress,
    # The true queries feed the statistics: there is no key stand-in.
    traits=Traits(
        signal=lambda state: "query",
        scope=lambda state: "head",
        budget=attrgetter("budget"),
        n_sink=attrgetter("n_sink"),
        reserved=attrgetter("recent"),
    ),
    lane_rule=EA_LANES,
    global_rule=GlobalRule(
        pending=lambda state: not state.compressed,
        scores=_cut_scores,
        cut=_cut,
        spare=2,
        when="prompt_end",
    ),
    summary={
        "expected_attention": "keeps the tokens that future queries, modelled from the recent "
        "ones, are expected to attend to most (Expected Attention)",
    },
    help={
        "budget": "tokens kept per KV head once the prompt has been cut",
        "recent": "latest tokens never evicted after the prompt's cut (default: 16, fewer when "
        "budget - n_sink - 1 is smaller)",
        "n_queries": "latest queries whose mean and covariance model the future ones",
        "refresh_every": "tokens between two recomputations of the statistics",
        "n_future": "future positions the RoPE rotation is averaged over",
        "use_covariance": "add the queries' covariance term to the expected logit",
        "use_vnorm": "multiply the expected attention by the value's norm",
        "epsilon": "added to the expected attention before the value norm multiplies it",
        "rope_base": "the model's RoPE base (filled in by KVCacheBuilder.for_model)",
        "rope_dims": "features the model's RoPE turns (default: the whole head; 0: no RoPE)",
        "rope_traditional": "whether the model's RoPE turns interleaved pairs",
        "rope_scale": "the model's RoPE position scale (linear scaling)",
        "allocation": "how the prompt's cut shares the rows: budget per head (uniform), a "
        "layer's heads by score (head, AdaKV) or every head of every layer (global)",
        "allocation_floor": "a head's least share under head allocation, as a fraction of budget",
    },
)
expected_attention_update = EXPECTED_ATTENTION.update
