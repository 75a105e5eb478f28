"""Expected Attention's model of future queries and the scores it gives keys (the policy:
:mod:`velox_cache_core.policies.expected_attention`).

The recent queries, un-rotated, are summarised as a Gaussian (:func:`query_stats`: mean and
per-head covariance), turned by the RoPE rotation averaged over the next positions
(:class:`RoPE`). A key's expected logit under ``q ~ N(mu, Sigma)`` is ``s mu.k + s^2 k'Sigma k
/ 2`` (:func:`expected_logits`); its score is that logit's softmax over the counted keys,
averaged over its GQA group, times ``||v||`` (:func:`expected_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_cache_core.attention_rule import History, extended
from velox_cache_core.engine import Call
from velox_cache_core.store import rows


@dataclass(frozen=True)
class RoPE:
    """How the model rotated its queries and keys (mlx's ``nn.RoPE``): the first ``dims``
    features turn by ``position * scale * base ** (-2i / dims)`` (``dims = 0``: no RoPE), in
    halves (``traditional=False``) or interleaved pairs."""

    base: float
    dims: int
    traditional: bool
    scale: float

    def angles(self, positions: mx.array) -> mx.array:
        """float32 ``[..., dims // 2]`` rotation angles of ``positions`` (int ``[...]``)."""
        exponents = mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims
        inv_freq = self.scale / (self.base**exponents)
        return positions.astype(mx.float32)[..., None] * inv_freq

    def turn(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """``x`` ``[..., D]`` with each rotated pair ``(a, b)`` mapped to ``(a cos - b sin,
        a sin + b cos)``; ``cos``/``sin`` ``[..., dims // 2]`` broadcast against ``x``."""
        if self.dims == 0:
            return x
        half = self.dims // 2
        if self.traditional:
            a, b = x[..., 0 : self.dims : 2], x[..., 1 : self.dims : 2]
        else:
            a, b = x[..., :half], x[..., half : self.dims]
        a, b = a * cos - b * sin, a * sin + b * cos
        if self.traditional:
            turned = mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], self.dims)
        else:
            turned = mx.concatenate([a, b], axis=-1)
        return mx.concatenate([turned, x[..., self.dims :]], axis=-1)

    def unrotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """``x`` ``[B, H, L, D]`` rotated at ``positions`` (int ``[L]``) back to its un-rotated
        form."""
        angles = self.angles(positions)
        return self.turn(x, mx.cos(angles), -mx.sin(angles))

    def mean_turn(self, start: int, n: int) -> tuple[mx.array, mx.array]:
        """(cos, sin) ``[dims // 2]`` of the rotation averaged over positions
        ``start .. start + n - 1``: ``turn(x, *mean_turn(...))`` applies it."""
        angles = self.angles(mx.arange(start, start + n))
        return mx.cos(angles).mean(axis=0), mx.sin(angles).mean(axis=0)


@dataclass(frozen=True)
class QueryStats:
    """The statistics of recent queries, turned to the future: ``mean`` float32 ``[B, H_q, D]``,
    ``cov`` float32 ``[B, H_q, D, D]`` (``None``: covariance left out)."""

    mean: mx.array
    cov: mx.array | None


def query_stats(
    queries: mx.array,
    positions: mx.array,
    *,
    n_sink: int,
    rope: RoPE,
    start: int,
    n_future: int,
    use_covariance: bool = True,
) -> QueryStats:
    """Mean and (biased) covariance of un-rotated ``queries`` ``[B, H_q, w, D]`` at
    ``positions`` int ``[w]``, the rows at positions ``< n_sink`` left out (zero statistics
    when none is left), turned by the RoPE rotation averaged over ``start .. start + n_future
    - 1``: ``mean = R mu``, ``cov = R Sigma R'``."""
    q = queries.astype(mx.float32)
    counted = (positions >= n_sink).astype(mx.float32)[:, None]  # [w, 1]
    count = mx.maximum(counted.sum(), 1.0)
    mu = (q * counted).sum(axis=2) / count
    cos, sin = rope.mean_turn(start, n_future)
    cov = None
    if use_covariance:
        centered = (q - mu[:, :, None]) * counted
        sigma = centered.swapaxes(-1, -2) @ centered / count
        turned = rope.turn(sigma, cos, sin)  # Sigma R'
        cov = rope.turn(turned.swapaxes(-1, -2), cos, sin).swapaxes(-1, -2)  # R Sigma R'
    return QueryStats(rope.turn(mu, cos, sin), cov)


def expected_logits(stats: QueryStats, keys: mx.array, scale: float) -> mx.array:
    """float32 ``[B, H_kv, G, n]``: ``scale mu.k + scale^2 k'Sigma k / 2`` of every query head
    (``G`` per KV head) for ``keys`` ``[B, H_kv, n, D]``."""
    B, H, _, D = keys.shape
    k = keys.astype(mx.float32)
    mean = stats.mean.reshape(B, H, -1, D)
    logits = scale * (mean @ k.swapaxes(-1, -2))
    if stats.cov is not None:
        cov = stats.cov.reshape(B, H, -1, D, D)
        spread = ((k[:, :, None] @ cov) * k[:, :, None]).sum(axis=-1)
        logits = logits + (scale * scale / 2) * spread
    return logits


def log_normalizer(logits: mx.array, counted: mx.array | None = None) -> mx.array:
    """``[B, H_kv, G, 1]`` log of the softmax denominator of ``logits`` ``[B, H_kv, G, n]``
    over the ``counted`` keys (bool ``[B, H_kv, n]``; ``None``: all)."""
    if counted is not None:  # a head without a counted key counts them all
        counted = counted | ~counted.any(axis=-1, keepdims=True)
        logits = mx.where(counted[:, :, None], logits, -mx.inf)
    return mx.logsumexp(logits, axis=-1, keepdims=True)


def scores_from_logits(
    logits: mx.array,
    log_norm: mx.array,
    values: rows.Rows,
    *,
    use_vnorm: bool,
    epsilon: float,
) -> mx.array:
    """float32 ``[B, H_kv, n]``: ``exp(logits - log_norm)`` averaged over each GQA group,
    times ``||v||`` when ``use_vnorm`` (as ``(p + epsilon) * ||v||``)."""
    probs = mx.exp(logits - log_norm).mean(axis=2)
    if not use_vnorm:
        return probs
    norms = mx.linalg.norm(rows.dense(values).astype(mx.float32), axis=-1)
    return (probs + epsilon) * norms


def expected_scores(
    stats: QueryStats,
    keys: mx.array,
    values: rows.Rows,
    *,
    scale: float,
    counted: mx.array | None = None,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> mx.array:
    """float32 ``[B, H_kv, n]``: the attention future queries are expected to give ``keys``
    ``[B, H_kv, n, D]`` (values ``[B, H_kv, n, D_v]``): the softmax of
    :func:`expected_logits` over the ``counted`` keys (bool ``[B, H_kv, n]``, e.g. the
    non-sinks; ``None``: all), averaged over each GQA group, times ``||v||`` when
    ``use_vnorm``. Scores of one batch row are comparable across its heads."""
    logits = expected_logits(stats, keys, scale)
    log_norm = log_normalizer(logits, counted)
    return scores_from_logits(logits, log_norm, values, use_vnorm=use_vnorm, epsilon=epsilon)


def window_stats(state: Any, window: History, head_dim: int, offset: int) -> QueryStats:
    """:func:`query_stats` of the query ``window`` with ``state``'s settings (heads of
    ``head_dim`` features), turned to the future starting at ``offset``."""
    return query_stats(
        window.probes,
        window.positions,
        n_sink=state.n_sink,
        rope=state.rope(head_dim),
        start=offset,
        n_future=state.n_future,
        use_covariance=state.use_covariance,
    )


def arrival_scores(state: Any, keys: rows.Rows, values: rows.Rows, scale: float) -> mx.array:
    """float32 ``[B, H_kv, n]``: new ``keys`` ``[B, H_kv, n, D]`` (and ``values``) scored on
    arrival with ``state``'s current statistics and its last scoring's normalizer."""
    k = rows.dense(keys)
    B, H = k.shape[:2]
    return scores_from_logits(
        expected_logits(state.stats, k, scale),
        state.log_norm.reshape(B, H, -1, 1),
        values,
        use_vnorm=state.use_vnorm,
        epsilon=state.epsilon,
    )


def remember(state: Any, call: Call) -> History:
    """The query window after ``call``: its queries un-rotated at their positions, appended."""
    assert call.queries is not None
    D = int(call.queries.shape[3])
    latest = call.queries[:, :, -state.n_queries :].astype(mx.float32)
    positions = call.positions()[-state.n_queries :]
    unrotated = state.rope(D).unrotate(latest, positions)
    window = extended(state.queries, unrotated, positions, state.n_queries)
    assert window is not None
    return window
