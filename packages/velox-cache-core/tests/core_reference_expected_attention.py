"""A plain numpy (float64) reference of Expected Attention (kvpress's ExpectedAttentionPress),
written from its definition with explicit rotation matrices and Python loops, not from the
engine.

Queries arrive rotated by RoPE at their positions: R(p) turns feature pairs (i, i + dims/2), or
(2i, 2i + 1) when traditional, by the angle p * scale * base ** (-2i / dims); the features past
`dims` stay. The reference keeps every query un-rotated (R(p)^T q).

Statistics at "now" t (the next position): over the last `n_queries` queries fed, those at
positions >= n_sink, per query head: mean mu and biased covariance Sigma (zeros when none is
left). Rbar = mean of R(f) over f = t .. t + n_future - 1; mu' = Rbar mu, Sigma' = Rbar Sigma
Rbar^T. A key k gets, per query head, logit s mu'.k + s^2 k^T Sigma' k / 2 (s: the softmax scale;
the second term only with use_covariance); the softmax denominator runs over the non-sink keys
scored (all of them when none is a non-sink); a key's score is exp(logit) / denominator averaged
over its GQA group, times ||v|| as (p + epsilon) * ||v|| with use_vnorm.

Prompt: nothing evicted. compress(): statistics at t = offset, every key scored, each KV head cut
to budget (the lowest non-sinks go, equal scores losing the lower position). After it, each call
adds its L tokens to a count; when the count reaches refresh_every, the statistics are recomputed
(at t = offset + L, the call's queries included), every candidate is scored and the count restarts
at 0; otherwise the new keys are scored with the current statistics and denominators. One token:
the lowest candidate goes when over budget, sinks and the `recent` newest positions (those after
the call's last position minus `recent`) never. A chunk attends causally, then the lowest of the
same evictable ones go down to budget. The prompt's cut spares only the sinks.

allocation "head" (AdaKV): the prompt's cut gives each KV head a share of the layer's
budget * H_kv rows by the same scores (`core_reference_lanes.ref_shares`, whole lanes, every head
at least its floor; protected: the sinks and the prompt's `recent` newest), keeps each head's
best rows of its share, then drops its lowest unprotected one (the lanes' dead row). Each head
then keeps share - 1 rows: every token is a candidate, and that head's lowest evictable goes.
The denominators run per head over its own rows, as always.
"""

from __future__ import annotations

import math

import numpy as np
from core_reference_lanes import order, ref_shares
from core_reference_siblings import _Reference

from velox_cache_core.allocation import shares as AS


def rotation(position: float, dim: int, rope: dict) -> np.ndarray:
    """R(position): the [dim, dim] matrix RoPE turns a vector by at that position."""
    dims = dim if rope["dims"] is None else rope["dims"]
    out = np.eye(dim)
    for i in range(dims // 2):
        angle = position * rope["scale"] * rope["base"] ** (-2 * i / dims)
        a, b = (2 * i, 2 * i + 1) if rope["traditional"] else (i, i + dims // 2)
        out[a, a] = out[b, b] = math.cos(angle)
        out[a, b], out[b, a] = -math.sin(angle), math.sin(angle)
    return out


class ReferenceExpectedAttention(_Reference):
    signal = "query"
    scope = "head"

    def __init__(
        self,
        budget: int,
        n_sink: int,
        recent: int,
        n_queries: int,
        refresh_every: int,
        n_future: int,
        use_covariance: bool,
        use_vnorm: bool,
        epsilon: float,
        rope_base: float | None,
        rope_dims: int | None,
        rope_traditional: bool,
        rope_scale: float,
        allocation: str = "uniform",
        allocation_floor: float = AS.FLOOR,
    ) -> None:
        super().__init__(budget, n_sink)
        self.allocation, self.floor = allocation, allocation_floor
        self.shares: list[list[int]] | None = None  # [b][h]: rows kept after each step (head)
        self.recent = recent
        self.n_queries, self.refresh_every, self.n_future = n_queries, refresh_every, n_future
        self.use_covariance, self.use_vnorm, self.epsilon = use_covariance, use_vnorm, epsilon
        self.rope = {
            "base": rope_base,
            "dims": rope_dims,
            "traditional": rope_traditional,
            "scale": rope_scale,
        }
        self.compressed = False
        self.count = 0  # tokens since the statistics were computed
        self.refresh = False  # whether the call being fed recomputes them
        self.raw: list[dict[int, list[np.ndarray]]] = []  # [b][t][qh]: un-rotated queries
        # per batch row: (mu' [H_q, D], Sigma' [H_q, D, D]) and log denominators [H_q]
        self.stats: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.log_norm: dict[int, np.ndarray] = {}
        self.scores: dict[int, list[dict[int, float]]] = {}  # [b][h]: {position: score}

    # ---------------------------------------------------------------- feeding

    def feed(self, keys, values, queries=None, scale=None):
        assert queries is not None, "expected_attention needs the queries"
        q = np.asarray(queries, dtype=np.float64)
        dim = q.shape[3]
        while len(self.raw) < q.shape[0]:
            self.raw.append({})
        for b in range(q.shape[0]):
            for i in range(q.shape[2]):
                back = rotation(self.offset + i, dim, self.rope).T
                self.raw[b][self.offset + i] = [back @ q[b, qh, i] for qh in range(q.shape[1])]
        due = self.count + q.shape[2] >= self.refresh_every or not self.stats
        self.refresh = self.compressed and due
        out = super().feed(keys, values, queries, scale)
        if self.compressed:
            self.count = 0 if self.refresh else self.count + q.shape[2]
        return out

    def _decide(self, b: int, length: int) -> None:
        assert self.kept is not None
        self._see_causally(b, length)
        chunk = [self.offset + i for i in range(length)]
        candidates = [self.kept[b][h] + chunk for h in range(self.n_kv)]
        self.kept[b] = candidates
        if not self.compressed or length == 0:
            return
        if self.refresh:
            self._rescore(b, self.offset + length)
        else:
            for h in range(self.n_kv):
                for t in chunk:
                    self.scores[b][h][t] = self._score(b, h, t)
        newest = self.offset + length - 1
        for h in range(self.n_kv):
            self._cut(b, h, spared=newest - self.recent)

    def compress(self) -> None:
        if self.compressed:
            return
        self.compressed = True
        self.count = 0
        if self.kept is None or self.offset == 0:
            return
        share_out = self.allocation == "head" and len(self.kept[0][0]) > self.budget
        for b in range(len(self.kept)):
            self._rescore(b, self.offset)
            if share_out:
                self._share_out(b)
                continue
            for h in range(self.n_kv):
                self._cut(b, h)

    def _share_out(self, b: int) -> None:
        """The head allocation's cut of batch row b (see the module doc)."""
        assert self.kept is not None
        H, newest = self.n_kv, self.offset - 1
        positions = np.array(self.kept[b][0])  # the prompt, uncut: the same in every head
        scores = np.array([[self.scores[b][h][p] for p in positions] for h in range(H)])
        protected = (positions < self.n_sink) | (positions > newest - self.recent)
        width = AS.lane_width(self.budget)
        least = AS.floor_rows(self.budget, self.floor, int(protected.sum()) + 2, width)
        pos3, prot3 = (
            np.broadcast_to(positions, (1, H, len(positions))),
            np.array([[protected] * H]),
        )
        counts = ref_shares(scores[None], pos3, prot3, self.budget * H, least, width)[0]
        shares = []
        for h in range(H):
            ranked = order(scores[h], positions, protected)
            best = [int(positions[i]) for i in ranked[: counts[h]]]
            evictable = {
                p: self.scores[b][h][p] for p in best if self.n_sink <= p <= newest - self.recent
            }
            dead = min(evictable, key=lambda p: (evictable[p], p))
            self.kept[b][h] = sorted(p for p in best if p != dead)
            self.scores[b][h] = {p: self.scores[b][h][p] for p in self.kept[b][h]}
            shares.append(int(counts[h]) - 1)
        if self.shares is None:
            self.shares = [[] for _ in self.kept]
        self.shares[b] = shares

    # ---------------------------------------------------------------- scoring

    def _cut(self, b: int, h: int, spared: float = math.inf) -> None:
        """Down to budget; positions after `spared` are never evicted."""
        assert self.kept is not None
        keeps = self.budget if self.shares is None else self.shares[b][h]
        excess = len(self.kept[b][h]) - keeps
        if excess <= 0:
            return
        evictable = {
            p: s
            for p, s in self.scores[b][h].items()
            if self.n_sink <= p and p <= spared and p not in self.pinned
        }
        evictable = {p: s for p, s in evictable.items() if p in self.kept[b][h]}
        gone = self._lowest(evictable, excess)
        self.kept[b][h] = [p for p in self.kept[b][h] if p not in gone]
        for p in gone:
            del self.scores[b][h][p]

    def _statistics(self, b: int, now: int) -> tuple[np.ndarray, np.ndarray]:
        window = [t for t in range(max(0, now - self.n_queries), now) if t in self.raw[b]]
        window = window[-self.n_queries :]
        used = [t for t in window if t >= self.n_sink]
        n_q = len(self.raw[b][window[-1]])
        dim = len(self.raw[b][window[-1]][0])
        mean = np.zeros((n_q, dim))
        cov = np.zeros((n_q, dim, dim))
        for qh in range(n_q):
            rows = np.array([self.raw[b][t][qh] for t in used]).reshape(len(used), dim)
            if len(used):
                mean[qh] = rows.mean(axis=0)
                centered = rows - mean[qh]
                cov[qh] = centered.T @ centered / len(used)
        average = sum(rotation(f, dim, self.rope) for f in range(now, now + self.n_future))
        average = average / self.n_future
        mean = np.einsum("ij,qj->qi", average, mean)
        cov = np.einsum("ij,qjk,lk->qil", average, cov, average)
        return mean, cov

    def _logits(self, b: int, h: int, t: int) -> np.ndarray:
        """Per query head of KV head h: the expected logit of the key at position t."""
        mean, cov = self.stats[b]
        group = mean.shape[0] // self.n_kv
        k = self.store[b][h][t][0]
        out = []
        for qh in range(h * group, (h + 1) * group):
            logit = self.scale * (mean[qh] @ k)
            if self.use_covariance:
                logit += self.scale**2 * (k @ cov[qh] @ k) / 2
            out.append(logit)
        return np.array(out)

    def _score(self, b: int, h: int, t: int) -> float:
        group = self.stats[b][0].shape[0] // self.n_kv
        log_norm = self.log_norm[b][h * group : (h + 1) * group]
        p = float(np.mean(np.exp(self._logits(b, h, t) - log_norm)))
        if self.use_vnorm:
            p = (p + self.epsilon) * float(np.linalg.norm(self.store[b][h][t][1]))
        return p

    def _rescore(self, b: int, now: int) -> None:
        assert self.kept is not None
        self.stats[b] = self._statistics(b, now)
        n_q = self.stats[b][0].shape[0]
        group = n_q // self.n_kv
        log_norm = np.zeros(n_q)
        for h in range(self.n_kv):
            counted = [p for p in self.kept[b][h] if p >= self.n_sink] or self.kept[b][h]
            logits = np.array([self._logits(b, h, p) for p in counted])  # [n, group]
            top = logits.max(axis=0)
            norm = top + np.log(np.exp(logits - top).sum(axis=0))
            log_norm[h * group : (h + 1) * group] = norm
        self.log_norm[b] = log_norm
        self.scores[b] = [
            {p: self._score(b, h, p) for p in self.kept[b][h]} for h in range(self.n_kv)
        ]
