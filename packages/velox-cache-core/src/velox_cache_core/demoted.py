"""A layer's demoted tier at work (the store: :mod:`velox_cache_core.store.tier`).

With a tier, every call of a :class:`~velox_cache_core.layer.Layer` waits for its queries and
runs on the general engine. For each call (each sub-chunk of a sequential prefill; each token
of a chunk of at most ``STEPPED_CHUNK`` tokens after the prompt, as without a tier such a
chunk runs as decode steps):

1. The policy decides over its candidates exactly as without a tier (the main rows a tier
   holds beside are the rows the same policy keeps without one).
2. The call's queries attend over the candidates (the policy's mask) and the tier's rows in
   one softmax: ``[B, H_q, L, D_v]``. Every tier row precedes the call, so every query sees
   all of them. The rows' weights in that softmax are the tier's scores.
3. The rows the state no longer holds (the rows the call found plus its new ones, less the
   rows kept) are demoted: quantized into the tier with the weight the call's last query gave
   them (summed over the call's queries for ``accumulated``; their position for
   ``recency``). The tier then drops its lowest-scored rows beyond its budget.

A cut outside a call (SnapKV's prompt end, KVzip's pass) demotes its victims with score 0
(the tier keeps the newest of them).

Trims (speculative decoding's rejected drafts) reach back within the last call: the tier keeps
no per-row log, so the layer keeps the tier as it was before its last call and that call's
inputs (:class:`TierUndo`, while its undo log can take the call back). A trim of ``n`` tokens
undoes the whole call (the main rows through the undo log, the tier by the copy), then decides
its first ``L - n`` tokens again as one call: what a layer that never saw the trimmed tokens
holds, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from velox_cache_core.attention import grouped_mask, times_values
from velox_cache_core.distributed import summing_over
from velox_cache_core.engine import Step
from velox_cache_core.in_flight import STEPPED_CHUNK, SUBCHUNK, Mode, Waiting
from velox_cache_core.scoring import grouped_logits
from velox_cache_core.store import rows
from velox_cache_core.store.channel_keys import KRows
from velox_cache_core.store.slots import KVSlots
from velox_cache_core.store.tier import Tier, TierSpec, demote, demote_one


@dataclass(frozen=True, eq=False)
class TierUndo:
    """What a trim within a layer's last call needs: the ``tier`` before the call, and the
    call's ``keys``/``values`` ``[B, H_kv, L, D]``, ``queries`` ``[B, H_q, L, D]``, ``scale``
    and ``sinks`` (to decide its first tokens again)."""

    tier: Tier | None
    keys: rows.Rows
    values: rows.Rows
    queries: mx.array
    scale: float
    sinks: mx.array | None

    @property
    def length(self) -> int:
        return int(self.queries.shape[2])


def check(policy: Any, state: Any, mode: Mode, spec: TierSpec | None) -> TierSpec | None:
    """``spec`` ranking rows as ``policy`` declares (``Policy.demote_scoring``);
    ``TypeError``/``ValueError`` unless a layer of ``policy`` in ``mode`` can hold it
    (``None``: no tier)."""
    if spec is None:
        return None
    if not isinstance(spec, TierSpec):
        raise TypeError(f"demote must be a TierSpec or None, got {type(spec).__name__}")
    if state.allocation != "uniform":
        raise ValueError(
            f"a demoted tier (demote_bits) works with allocation='uniform', got "
            f"allocation={state.allocation!r} ({policy.name}): heads keeping different row "
            "counts have no tier yet"
        )
    if mode is Mode.AT_ONCE:
        raise ValueError("a demoted tier is attended by the hook: mode AT_ONCE cannot hold one")
    return replace(spec, scoring=policy.demote_scoring)


def attend(
    queries: mx.array, step: Step, tier: Tier | None, scale: float, sinks: mx.array | None
) -> tuple[mx.array, mx.array, mx.array | None]:
    """``queries [B, H_q, L, D]`` over the step's candidates (its mask applied) and ``tier``
    in one softmax: (output ``[B, H_q, L, D_v]``, weights over the candidates and over the
    tier, float32 ``[B, H_kv, H_q / H_kv, L, n or T]``). ``sinks``: per-head sink logits
    ``[H_q]``, in the normalizer only."""
    B, H_q, L, _ = queries.shape
    H_kv = int(step.keys.shape[1])
    g = H_q // H_kv
    main = grouped_logits(queries, step.keys, scale, "head")  # [B, H_kv, g, L, n]
    n = int(main.shape[-1])
    if step.mask is not None:
        main = mx.where(grouped_mask(step.mask, H_q, H_kv), main, mx.finfo(mx.float32).min)
    if tier is not None and not tier.n_rows:
        tier = None
    parts = [main]
    if tier is not None:
        parts.append(grouped_logits(queries, tier.keys, scale, "head"))
    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(1, H_kv, g, 1, 1)
        parts.append(mx.broadcast_to(sink, (B, H_kv, g, L, 1)))
    logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    probs = mx.softmax(logits, axis=-1, precise=True)
    p_main = probs[..., :n]
    out = times_values(p_main.astype(step.values.dtype), step.values)
    p_tier = None
    if tier is not None:
        p_tier = probs[..., n : n + tier.n_rows]
        out = out + times_values(p_tier.astype(tier.values.dtype), tier.values)
    D_v = int(out.shape[-1])
    return out.reshape(B, H_q, L, D_v).astype(queries.dtype), p_main, p_tier


def scores_of(spec: TierSpec, probs: mx.array) -> mx.array:
    """Per KV head ``[B, H_kv, m]``: the weights ``probs [B, H_kv, g, L, m]`` gave each row,
    averaged over the head's queries; the last query's, or summed over the call's queries
    (``accumulated``)."""
    per_head = probs.mean(axis=2)
    return per_head.sum(axis=2) if spec.scoring == "accumulated" else per_head[:, :, -1]


def victims(
    before: KVSlots | None,
    keys: rows.Rows | None,
    values: rows.Rows | None,
    start: int,
    after: KVSlots | None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """The rows ``before`` held and the call's new ``keys``/``values`` (positions ``start``
    on) that ``after`` does not: full-precision keys, values ``[B, H_kv, V, D]`` and positions
    ``[B, H_kv, V]`` in the order they came; ``None`` when nothing went."""
    parts: list[tuple[mx.array, mx.array, mx.array]] = []
    if before is not None:
        live = before.compact()
        parts.append((rows.dense(live.keys), rows.dense(live.values), live.positions))
    if keys is not None and values is not None and int(keys.shape[2]):
        B, H, L = (int(s) for s in keys.shape[:3])
        new = mx.broadcast_to(start + mx.arange(L, dtype=mx.int32), (B, H, L))
        parts.append((rows.dense(keys), rows.dense(values), new))
    if not parts:
        return None
    key_rows, value_rows, positions = (
        parts[0]
        if len(parts) == 1
        else (mx.concatenate(list(xs), axis=2) for xs in zip(*parts, strict=True))
    )
    N = int(positions.shape[2])
    V = N - (0 if after is None else after.n_kept)
    if V <= 0:
        return None
    if after is None:  # every row went
        return key_rows, value_rows, positions
    held = after.compact().positions
    gone = ~(positions[..., :, None] == held[..., None, :]).any(axis=-1)
    index = mx.arange(N, dtype=mx.int32)
    order = mx.argsort(mx.where(gone, index, index + N), axis=-1)[..., :V]
    return (
        mx.take_along_axis(key_rows, order[..., None], axis=2),
        mx.take_along_axis(value_rows, order[..., None], axis=2),
        mx.take_along_axis(positions, order, axis=2),
    )


def demote_gone(
    spec: TierSpec,
    tier: Tier | None,
    before: Any,
    after: Any,
    keys: rows.Rows | None = None,
    values: rows.Rows | None = None,
    weights: tuple[mx.array, mx.array] | None = None,
) -> Tier | None:
    """``tier`` with what went between states ``before`` and ``after`` demoted into it
    (a call's new ``keys``/``values`` included); ``weights``: the call's scores of its
    candidates ``[B, H_kv, n]`` and their positions, else the rows score 0."""
    gone = _evicted_by_step(keys, after.slots)
    if gone is None:
        gone = victims(before.slots, keys, values, before.offset, after.slots)
    if gone is None:
        return tier
    k, v, p = gone
    if spec.scoring == "recency":
        s = p.astype(mx.float32)
    elif weights is None:
        s = mx.zeros(p.shape, dtype=mx.float32)
    else:
        w, at = weights
        s = (w[:, :, None, :] * (p[..., None] == at[:, :, None, :])).sum(axis=-1)
    if tier is not None and tier.n_rows == spec.budget and int(p.shape[2]) == 1:
        return demote_one(spec, tier, k, v, p, s)  # a decode step's victim, in place
    return demote(spec, tier, k, v, p, s)


def _evicted_by_step(
    keys: rows.Rows | None, after: KVSlots | None
) -> tuple[mx.array, mx.array, mx.array] | None:
    """A decode step's victim where the step left it, without comparing positions: the dead
    slot of the state after a single-token call that evicted (its row is still in place)."""
    if keys is None or int(keys.shape[2]) != 1 or after is None or after.free is None:
        return None
    if isinstance(after.keys, KRows):
        return None  # keys per channel: a row is read through the groups (the general way)
    at = after.free[:, :, None]
    return (
        rows.dense(rows.take(after.keys, at)),
        rows.dense(rows.take(after.values, at)),
        mx.take_along_axis(after.positions, at, axis=2),
    )


def decide(
    layer: Any, pending: Waiting, queries: mx.array, scale: float, sinks: mx.array | None
) -> mx.array:
    """A waiting call decided with its queries, attended with the tier and its victims
    demoted (a sequential prefill in sub-chunks, as without a tier)."""
    spec: TierSpec = layer.demote
    keys, values = pending.keys, pending.values
    L = int(keys.shape[2])
    log = layer.log
    undo = None
    if log is not None and log.window >= L:  # a trim may take this call back
        undo = TierUndo(layer.tier, keys, values, queries, scale, sinks)
    size = _part_size(layer, L)
    outs = []
    for s in range(0, L, size):
        part = slice(s, s + size)
        q, k, v = queries[:, :, part], keys[:, :, part], values[:, :, part]
        before = layer.state
        step = layer._feed(before, keys=k, values=v, queries=q, scale=scale)
        tier = layer.tier
        out, p_main, p_tier = attend(q, step, tier, scale, sinks)
        if tier is not None and p_tier is not None and spec.scoring != "recency":
            w = scores_of(spec, p_tier)
            tier = tier.rescored(tier.scores + w if spec.scoring == "accumulated" else w)
        at = step.positions
        weights = None if at is None else (scores_of(spec, p_main), at)
        layer.shared_tier = layer.tier  # a layer sharing these rows attends as this call did
        layer.tier = demote_gone(spec, tier, before, step.state, k, v, weights)
        layer.state = step.state
        outs.append(out)
    # a layer sharing these rows attends as the call did: one step (sub-chunks have several)
    layer.last = step if len(outs) == 1 else None
    ended = layer.state
    layer.state = layer._after_call(ended, L)
    cut(layer, ended)
    log = layer.log
    layer.tier_undo = undo if log is not None and log.tokens >= L else None
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)


def _part_size(layer: Any, L: int) -> int:
    """Tokens per part of a call of ``L``: sub-chunks of a long sequential prefill; single
    tokens for a short chunk after the prompt (a verify chunk: as decode steps, so that each
    token sees the rows the tokens before it demoted, as plain decoding does); else ``L``."""
    if L > SUBCHUNK and layer.policy.traits.prefill(layer.state) == "sequential":
        return SUBCHUNK
    if L <= STEPPED_CHUNK and layer.state.slots is not None:
        return 1
    return L


def reach(layer: Any) -> int:
    """How many of the last tokens a layer with a tier can take back now."""
    undo: TierUndo | None = layer.tier_undo
    log = layer.log
    return 0 if undo is None or log is None else min(undo.length, log.tokens)


def trim(layer: Any, n: int) -> None:
    """Forget the last ``n`` tokens of a layer with a tier exactly (module docstring);
    ``ValueError`` and no change beyond :func:`reach`."""
    if n == 0:
        return
    back = reach(layer)
    undo: TierUndo | None = layer.tier_undo
    if undo is None or n > back:
        raise ValueError(
            f"cannot trim {n} tokens of a {layer.policy.name} cache with a demoted tier "
            f"(demote_bits): a trim reaches back within the last call only ({back} tokens now; "
            "speculative decoding's trims always do), as the tier keeps its state before that "
            "call and no per-row log"
        )
    with summing_over(layer.group):
        state, log = layer.policy.trim(layer.state, layer.log, undo.length)
    layer.state, layer.log, layer.tier = state, log, undo.tier
    layer.tier_undo = None
    layer.release()  # the trimmed call's copies
    keep = undo.length - n
    if keep:
        part = Waiting(undo.keys[:, :, :keep], undo.values[:, :, :keep])
        decide(layer, part, undo.queries[:, :, :keep], undo.scale, undo.sinks)


def cut(layer: Any, before: Any) -> None:
    """Demote what a cut outside a call (a prompt end, a model-driven pass) took from
    ``before`` to the layer's state now."""
    if layer.demote is not None and layer.state is not before:
        layer.tier = demote_gone(layer.demote, layer.tier, before, layer.state)
