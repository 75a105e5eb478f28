"""Plain numpy references for TOVA's siblings (docs/architecture.md section 4): H2O,
StreamingLLM, SnapKV and MorphKV. Written for clarity, not speed, from the policies' definitions
(not the engine).

Every decision is taken with Python loops over batch rows, KV heads and tokens. State per batch
row `b` and KV head `h`: `kept[b][h]`, the retained absolute positions; `store[b][h][t]` holds the
(key, value) of every position ever fed and `probes[b][t]` its probe rows (the reference never
forgets a row, it only marks it evicted).

After each `feed`:
  - `last_visible[b][h][i]`: sorted positions query `i` of the call attended to (KV head `h`).
  - `min_margin`: the smallest relative gap, over every eviction decision so far, between the
    last evicted score and the first kept one. Tests skip examples where it is so small that fp32
    rounding could flip the decision.
"""

from __future__ import annotations

import math

import numpy as np

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")
PREFILLS = ("sequential", "oneshot")
FUSIONS = ("mean", "max")


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


class _Reference:
    """What every sibling shares: storage, probe rows, weights, eviction choice, outputs."""

    signal = "key"
    scope = "head"

    def __init__(self, budget: int, n_sink: int) -> None:
        assert 0 <= n_sink < budget
        self.budget = budget
        self.n_sink = n_sink
        # positions never evicted besides the sinks (pinned spans); set by a test
        self.pinned: set[int] = set()
        self.offset = 0
        self.scale = 1.0
        self.n_kv = 0
        self.kept: list[list[list[int]]] | None = None
        self.store: list[list[dict[int, tuple[np.ndarray, np.ndarray]]]] = []
        # probes[b][t]: list of (KV head read, probe vector) of position t.
        self.probes: list[dict[int, list[tuple[int, np.ndarray]]]] = []
        self.last_visible: list[list[list[list[int]]]] = []
        self.min_margin = math.inf

    # ---------------------------------------------------------------- public

    def feed(
        self,
        keys: np.ndarray,
        values: np.ndarray,
        queries: np.ndarray | None = None,
        scale: float | None = None,
    ) -> tuple[np.ndarray | None, list[list[list[int]]]]:
        """Feed one call's new tokens.

        keys, values: [B, H_kv, L, D]; queries: [B, H_q, L, D] or None (required for signal
        "query"). Returns (attention output [B, H_q, L, D] or None without queries, retained
        positions [b][h] as sorted lists).
        """
        keys = np.asarray(keys, dtype=np.float64)
        values = np.asarray(values, dtype=np.float64)
        n_batch, n_kv, length, dim = keys.shape
        if queries is not None:
            queries = np.asarray(queries, dtype=np.float64)
        if self.signal == "query":
            assert queries is not None, "signal 'query' needs the queries"
        self.scale = 1.0 / math.sqrt(dim) if scale is None else scale
        if self.kept is None:
            self.n_kv = n_kv
            self.kept = [[[] for _ in range(n_kv)] for _ in range(n_batch)]
            self.store = [[{} for _ in range(n_kv)] for _ in range(n_batch)]
            self.probes = [{} for _ in range(n_batch)]

        for b in range(n_batch):
            for i in range(length):
                t = self.offset + i
                for h in range(n_kv):
                    self.store[b][h][t] = (keys[b, h, i], values[b, h, i])
                if self.signal == "query":
                    assert queries is not None
                    group = queries.shape[1] // n_kv
                    rows = [(qh // group, queries[b, qh, i]) for qh in range(queries.shape[1])]
                else:
                    rows = [(h, keys[b, h, i]) for h in range(n_kv)]
                self.probes[b][t] = rows

        self.last_visible = [
            [[[] for _ in range(length)] for _ in range(n_kv)] for _ in range(n_batch)
        ]
        for b in range(n_batch):
            self._decide(b, length)

        outputs = None
        if queries is not None:
            outputs = self._outputs(queries, length, dim)
        self.offset += length
        return outputs, self.positions()

    def positions(self) -> list[list[list[int]]]:
        assert self.kept is not None
        return [[sorted(kept_h) for kept_h in kept_b] for kept_b in self.kept]

    def kept_rows(self, b: int, h: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Retained (positions, keys, values) of one (b, h), sorted by position."""
        assert self.kept is not None
        positions = sorted(self.kept[b][h])
        store = self.store[b][h]
        dim = len(next(iter(store.values()))[0]) if store else 0
        keys = np.array([store[t][0] for t in positions]).reshape(len(positions), dim)
        values = np.array([store[t][1] for t in positions]).reshape(len(positions), dim)
        return positions, keys, values

    # ------------------------------------------------------------ per policy

    def _decide(self, b: int, length: int) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- shared

    def _row_weights(self, b: int, candidates: list[list[int]], row: int) -> list[dict[int, float]]:
        """Per KV head: {position: weight} of the probe row of position `row` over the candidates.

        Each probe head's softmax runs over the candidates of its KV head with position <= row
        (the others get weight 0); the rows are averaged per decision group: all probe heads for
        scope "layer", the heads reading KV head h for scope "head".
        """
        rows: list[tuple[int, dict[int, float]]] = []
        for owner, probe in self.probes[b][row]:
            visible = [p for p in candidates[owner] if p <= row]
            logits = np.array([probe @ self.store[b][owner][p][0] * self.scale for p in visible])
            probs = softmax(logits)
            rows.append((owner, {p: float(w) for p, w in zip(visible, probs, strict=True)}))
        weights = []
        for h in range(len(candidates)):
            if self.scope == "layer":
                used = [r for _, r in rows]
            else:
                used = [r for owner, r in rows if owner == h]
            weights.append({p: sum(r.get(p, 0.0) for r in used) / len(used) for p in candidates[h]})
        return weights

    def _lowest(self, scores: dict[int, float], count: int) -> set[int]:
        """The `count` lowest-scoring positions; equal scores evict the lower position first."""
        order = sorted((s, p) for p, s in scores.items())
        assert len(order) >= count
        if len(order) > count and count > 0:
            last_out, first_in = order[count - 1][0], order[count][0]
            gap = (first_in - last_out) / max(abs(first_in), abs(last_out), 1e-300)
            self.min_margin = min(self.min_margin, gap)
        return {p for _, p in order[:count]}

    def _see_causally(self, b: int, length: int) -> None:
        """Query i of the chunk sees everything retained and the chunk up to itself."""
        assert self.kept is not None
        for h in range(self.n_kv):
            for i in range(length):
                chunk = [self.offset + j for j in range(i + 1)]
                self.last_visible[b][h][i] = sorted(self.kept[b][h] + chunk)

    def _outputs(self, queries: np.ndarray, length: int, dim: int) -> np.ndarray:
        n_batch, n_q = queries.shape[:2]
        group = n_q // self.n_kv
        outputs = np.zeros((n_batch, n_q, length, dim))
        for b in range(n_batch):
            for qh in range(n_q):
                h = qh // group
                for i in range(length):
                    visible = self.last_visible[b][h][i]
                    logits = [
                        queries[b, qh, i] @ self.store[b][h][p][0] * self.scale for p in visible
                    ]
                    probs = softmax(np.array(logits))
                    for p, w in zip(visible, probs, strict=True):
                        outputs[b, qh, i] += w * self.store[b][h][p][1]
        return outputs


class ReferenceH2O(_Reference):
    """H2O (arXiv:2306.14048): running sums of the attention each token received.

    Step t: candidates C = retained + {t}; t's score starts at 0; every candidate's score grows by
    its current-step weight; if |C| > budget the lowest score goes among the non-sinks older than
    the `recent` newest positions (ties: lower position). Oneshot chunk: every query attends
    causally and adds its weights; then the union is cut to budget by highest score.
    `scores[b][h]`: {position: running sum} of the retained positions.
    """

    def __init__(
        self,
        budget: int,
        n_sink: int,
        recent: int,
        signal: str,
        scope: str,
        prefill: str,
        allocation: str = "uniform",
        allocation_floor: float = 0.2,
    ) -> None:
        super().__init__(budget, n_sink)
        # the uniform cut (head allocation has its own reference: test_h2o_allocation.py)
        assert allocation == "uniform" and 0 <= allocation_floor <= 1
        assert 0 <= recent <= budget - n_sink
        assert signal in SIGNALS and scope in SCOPES and prefill in PREFILLS
        self.recent, self.signal, self.scope, self.prefill = recent, signal, scope, prefill
        self.scores: list[list[dict[int, float]]] = []

    def _evictable(self, scores: dict[int, float], newest: int) -> dict[int, float]:
        return {
            p: s
            for p, s in scores.items()
            if p >= self.n_sink and p <= newest - self.recent and p not in self.pinned
        }

    def _decide(self, b: int, length: int) -> None:
        assert self.kept is not None
        while len(self.scores) <= b:
            self.scores.append([{} for _ in range(self.n_kv)])
        scores = self.scores[b]
        if self.prefill == "sequential" or length == 1:
            for i in range(length):
                t = self.offset + i
                candidates = [self.kept[b][h] + [t] for h in range(self.n_kv)]
                weights = self._row_weights(b, candidates, t)
                for h in range(self.n_kv):
                    self.last_visible[b][h][i] = sorted(candidates[h])
                    scores[h][t] = 0.0
                    for p in candidates[h]:
                        scores[h][p] += weights[h][p]
                    if len(candidates[h]) > self.budget:
                        (victim,) = self._lowest(self._evictable(scores[h], t), 1)
                        candidates[h].remove(victim)
                        del scores[h][victim]
                self.kept[b] = candidates
            return
        self._see_causally(b, length)
        chunk = [self.offset + i for i in range(length)]
        candidates = [self.kept[b][h] + chunk for h in range(self.n_kv)]
        for h in range(self.n_kv):
            for t in chunk:
                scores[h][t] = 0.0
        for t in chunk:
            weights = self._row_weights(b, candidates, t)  # row t sees positions <= t
            for h in range(self.n_kv):
                for p in candidates[h]:
                    scores[h][p] += weights[h][p]
        for h in range(self.n_kv):
            excess = len(candidates[h]) - self.budget
            if excess > 0:
                gone = self._lowest(self._evictable(scores[h], chunk[-1]), excess)
                candidates[h] = [p for p in candidates[h] if p not in gone]
                for p in gone:
                    del scores[h][p]
        self.kept[b] = candidates


class ReferenceStreamingLLM(_Reference):
    """StreamingLLM (arXiv:2309.17453): sinks plus the most recent tokens.

    Position t first drops the oldest non-sink if `budget` tokens are retained, then attends to
    what is retained (itself included). A chunk behaves exactly like its tokens one by one.
    """

    def _decide(self, b: int, length: int) -> None:
        assert self.kept is not None
        for i in range(length):
            t = self.offset + i
            for h in range(self.n_kv):
                kept = self.kept[b][h]
                if len(kept) >= self.budget:
                    kept.remove(min(p for p in kept if p >= self.n_sink and p not in self.pinned))
                kept.append(t)
                self.last_visible[b][h][i] = sorted(kept)


class ReferenceSnapKV(_Reference):
    """SnapKV (arXiv:2404.14469): nothing evicted while fed; `compress` cuts the prompt once.

    compress: per (b, KV head), each of the last `window` probe rows takes a softmax over the
    prompt keys at positions <= its own; the probabilities are summed over the rows and averaged
    over the head's GQA group (scope "head"); the scores of the prefix (all but the last
    `window` positions) are smoothed by a zero-padded moving average of width `kernel`
    (torch avg_pool1d, stride 1, padding kernel // 2, padding counted); the `budget - window`
    best prefix positions and the window are kept. Later tokens are appended, never evicted.
    """

    def __init__(
        self,
        budget: int,
        window: int,
        kernel: int,
        signal: str,
        allocation: str = "uniform",
        allocation_floor: float = 0.2,
    ) -> None:
        super().__init__(budget, 0)
        assert 1 <= window < budget and kernel % 2 == 1
        # the uniform cut (head allocation has its own reference: test_snapkv.py)
        assert allocation == "uniform" and 0 <= allocation_floor <= 1
        assert signal in SIGNALS
        self.window, self.kernel, self.signal = window, kernel, signal
        self.compressed = False

    def _decide(self, b: int, length: int) -> None:
        assert self.kept is not None
        for i in range(length):
            t = self.offset + i
            for h in range(self.n_kv):
                self.kept[b][h].append(t)
                self.last_visible[b][h][i] = sorted(self.kept[b][h])

    def compress(self) -> None:
        if self.compressed:
            return
        self.compressed = True
        if self.kept is None or len(self.kept[0][0]) <= self.budget:
            return
        n, window = self.offset, self.window
        assert all(kept_h == list(range(n)) for kept_b in self.kept for kept_h in kept_b)
        for b in range(len(self.kept)):
            candidates = [list(range(n)) for _ in range(self.n_kv)]
            scores = [dict.fromkeys(range(n), 0.0) for _ in range(self.n_kv)]
            for row in range(n - window, n):
                weights = self._row_weights(b, candidates, row)
                for h in range(self.n_kv):
                    for p in range(n):
                        scores[h][p] += weights[h][p]
            for h in range(self.n_kv):
                prefix = n - window
                pad = self.kernel // 2
                pooled = {}
                for p in range(prefix):
                    near = [scores[h][j] for j in range(p - pad, p + pad + 1) if 0 <= j < prefix]
                    pooled[p] = sum(near) / self.kernel
                free = {p: w for p, w in pooled.items() if p not in self.pinned}
                gone = self._lowest(free, prefix - (self.budget - window))
                self.kept[b][h] = [p for p in range(n) if p not in gone]


class ReferenceMorphKV(_Reference):
    """MorphKV (arXiv:2503.00979): TOVA's weights fused over the last `window` probe rows.

    Step t: candidates C = retained + {t}; if |C| > budget, each probe row of positions
    t - window + 1 .. t (those >= 0) takes a softmax over the candidates at positions <= its own,
    head-averaged per decision group as in TOVA; the rows are fused by mean (invisible candidates
    count 0) or max; the lowest goes among the non-sinks older than the `window - 1` newest
    positions (ties: lower position). Oneshot chunk: causal attention, then the union is cut to
    budget by the fused weights of the chunk's last `window` rows.
    """

    def __init__(
        self,
        budget: int,
        n_sink: int,
        window: int,
        fusion: str,
        signal: str,
        scope: str,
        prefill: str,
    ) -> None:
        super().__init__(budget, n_sink)
        assert 1 <= window <= budget - n_sink + 1 and fusion in FUSIONS
        assert signal in SIGNALS and scope in SCOPES and prefill in PREFILLS
        self.window, self.fusion = window, fusion
        self.signal, self.scope, self.prefill = signal, scope, prefill

    def _fused(self, b: int, candidates: list[list[int]], newest: int) -> list[dict[int, float]]:
        rows = [
            self._row_weights(b, candidates, r)
            for r in range(max(0, newest - self.window + 1), newest + 1)
        ]
        fused = []
        for h in range(self.n_kv):
            per_row = [[w[h][p] for w in rows] for p in candidates[h]]
            pick = max if self.fusion == "max" else (lambda ws: sum(ws) / len(ws))
            fused.append({p: pick(ws) for p, ws in zip(candidates[h], per_row, strict=True)})
        return fused

    def _evictable(self, weights: dict[int, float], newest: int) -> dict[int, float]:
        return {
            p: w
            for p, w in weights.items()
            if p >= self.n_sink and p <= newest - (self.window - 1) and p not in self.pinned
        }

    def _decide(self, b: int, length: int) -> None:
        assert self.kept is not None
        if self.prefill == "sequential" or length == 1:
            for i in range(length):
                t = self.offset + i
                candidates = [self.kept[b][h] + [t] for h in range(self.n_kv)]
                for h in range(self.n_kv):
                    self.last_visible[b][h][i] = sorted(candidates[h])
                if len(candidates[0]) > self.budget:
                    weights = self._fused(b, candidates, t)
                    for h in range(self.n_kv):
                        (victim,) = self._lowest(self._evictable(weights[h], t), 1)
                        candidates[h].remove(victim)
                self.kept[b] = candidates
            return
        self._see_causally(b, length)
        newest = self.offset + length - 1
        candidates = [
            self.kept[b][h] + list(range(self.offset, newest + 1)) for h in range(self.n_kv)
        ]
        if len(candidates[0]) > self.budget:
            weights = self._fused(b, candidates, newest)
            for h in range(self.n_kv):
                excess = len(candidates[h]) - self.budget
                gone = self._lowest(self._evictable(weights[h], newest), excess)
                candidates[h] = [p for p in candidates[h] if p not in gone]
        self.kept[b] = candidates
