"""Calls decided without their true queries.

- A call the queries never reached (the attention hook did not see it: a model that computes
  attention by hand, or no hook installed): :func:`settle` decides it as the hook would
  have, with signal ``key`` standing in for ``query`` (a warning once per policy), or refuses
  where that cannot be consistent.
- Attention over the model's own keys and values derived row by row from what the cache
  returned (absorbed latent attention), plus scores of its own: :func:`attend_rows` decides the
  call with signal ``key`` (the policy's scoring cannot read those queries) and the policy's mask
  hides what it evicted.

A policy scoring by the true queries without a ``signal`` setting (Expected Attention) has no
stand-in: both refuse instead (:func:`decide_keyed`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import mlx.core as mx

from velox_cache_core.engine import Step
from velox_cache_core.in_flight import Decided, Waiting

_warned_rows: set[str] = set()
_warned_no_hook: set[str] = set()


def attend_rows(
    layer: Any,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    scores: mx.array | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of ``queries [B, H_q, L, D_q]`` over the model's own ``keys``/``values``
    ``[B, H, n, *]``, derived row by row from what :meth:`lay_out` returned (the same
    ``n`` rows in the same order, e.g. latent attention's up-projections), plus the
    model's additive ``scores`` ``[B?, H?, L, n]`` (latent attention's RoPE part). The
    call is decided with signal ``key`` (the policy's scoring cannot read these queries),
    with a warning once; the policy's mask hides what it evicted."""
    model = layer.serves or "the model"
    if layer.demote is not None:
        raise ValueError(
            f"{model} derives its own rows from the cache's, which a demoted tier's quantized "
            "rows cannot follow: use demote_bits=None with this model"
        )
    pending, layer.pending = layer.pending, None
    if isinstance(pending, Decided):
        layer.state = layer._after_call(pending.step.state, pending.length)
        step = layer.last = pending.step
    elif isinstance(pending, Waiting):
        name = layer.policy.name
        who = layer.serves or name
        why = f"{who} attends over keys, values or scores of its own, not the cache's"
        warning = f"{why}: the {name} cache scores with signal 'key' there."
        step = decide_keyed(layer, pending, why, _warned_rows, who, warning)
        layer.last = replace(step, state=layer.state)
    else:
        layer.pending = pending
        if layer.last is None:
            raise RuntimeError("attend() called before update_and_fetch()")
        step = layer.last  # a layer sharing this one's keys and values
    n = int(step.keys.shape[2])
    if keys.shape[2] != n or values.shape[2] != n:
        raise ValueError(
            f"{model} attends over {keys.shape[2]} rows, but this cache returned {n}: Velox "
            "cannot tell which rows it evicted there"
        )
    visible = step.mask
    if visible is not None and visible.shape[1] not in (1, queries.shape[1]):
        if keys.shape[1] != step.keys.shape[1]:
            raise ValueError(
                f"{model} regroups the cache's {step.keys.shape[1]} KV heads into "
                f"{keys.shape[1]} before attention, and this {layer.policy.name} cache evicts "
                "per head: use scope='layer'"
            )
        visible = mx.repeat(visible, queries.shape[1] // visible.shape[1], axis=1)
    mask = scores
    if visible is not None:
        floor = mx.array(mx.finfo(queries.dtype).min, queries.dtype)
        mask = mx.where(visible, 0.0 if mask is None else mask, floor)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def settle(layer: Any, pending: Decided | Waiting) -> None:
    """Settle ``pending``, a call whose queries never came: a decided call ends as its
    attention would have ended it, a waiting one is decided without them. ``RuntimeError``,
    the call left pending, where the model's own attention cannot have been consistent with
    the cache: a cache nested where only the hook may reach it, a demoted tier, rows only the
    hook's masks hide, or an adaptive allocation's per-head lanes."""
    name = layer.policy.name
    if layer.must_attend:
        raise RuntimeError(
            f"{layer.serves or 'the model'} uses this {name} cache outside its attention call "
            "(the attention hook never saw the call), so Velox cannot evict it consistently "
            "with the model's other uses of it; serve this model with method='full'"
        )
    if layer.demote is not None:
        raise RuntimeError(
            f"this {name} cache demotes evicted rows into a tier that only the attention hook "
            "attends (velox_mlx_lm.install_attention_hook(model); KVCacheBuilder.for_model "
            "does), and the last call ran without it"
        )
    if layer.policy.traits.hides_rows(layer.state) or layer.state.lanes is not None:
        # The model attended by itself: over rows only the hook's masks hide, or without the
        # rows an adaptive allocation keeps per head (lanes), which only it reads.
        raise RuntimeError(
            f"this {name} cache holds rows that only the attention hook attends correctly (pad "
            "slots or per-head lanes), and the last call ran without it: install it "
            "(velox_mlx_lm.install_attention_hook(model); KVCacheBuilder.for_model does)"
        )
    layer.pending = None
    if isinstance(pending, Decided):  # attention never came back
        layer.state = layer._after_call(layer.state, pending.length)
        return
    why = (
        f"a call of {layer.serves or 'this layer'} came without them: the attention hook never "
        "saw it (KVCacheBuilder.for_model installs it; it cannot reach a model that computes "
        "attention by hand)"
    )
    warning = (
        f"a {name} cache was used without the attention hook (KVCacheBuilder.for_model "
        "installs it): eviction fell back to signal 'key'."
    )
    decide_keyed(layer, pending, why, _warned_no_hook, name, warning)


def decide_keyed(
    layer: Any, pending: Waiting, why: str, warned: set[str], key: str, warning: str
) -> Step:
    """Decide ``pending`` without its queries (:func:`attend_rows`, :func:`settle`). A state
    scoring by the true queries is decided with signal ``key`` standing in (``warning`` once
    per ``key`` in ``warned``), unless its policy has no stand-in (no ``signal`` setting:
    Expected Attention's statistics are the queries'): ``ValueError`` saying ``why`` the
    queries are missing, the call left pending."""
    state = layer.state
    query = layer.policy.traits.signal(state) == "query"
    if query:
        if "signal" not in state.settings:
            layer.pending = pending
            raise ValueError(
                f"{layer.policy.name} needs the true queries (it has no signal='key' "
                f"stand-in), but {why}; serve this model with another method"
            )
        if key not in warned:
            warned.add(key)
            # at attend_rows's caller's caller, or at Layer.settle's caller
            warnings.warn(warning, RuntimeWarning, stacklevel=4)
        state = replace(state, signal="key")
    step = layer._feed(state, keys=pending.keys, values=pending.values)
    after = replace(step.state, signal="query") if query else step.state
    layer.state = layer._after_call(after, int(pending.keys.shape[2]))
    return step
