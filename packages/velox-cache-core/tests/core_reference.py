"""Plain numpy reference for TOVA (docs/architecture.md section 3), written for clarity, not speed.

TOVA: arXiv:2401.06104. Every decision is taken with Python loops over batch rows, heads and
tokens so that each line can be checked against the design by eye. The engine under test must
match it: same retained positions after every call and the same attention outputs.
"""

from __future__ import annotations

import math

import numpy as np

SIGNALS = ("query", "key")
SCOPES = ("layer", "head")
PREFILLS = ("sequential", "oneshot")


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


class ReferenceTova:
    """Token-by-token TOVA over numpy float64 copies of the inputs.

    State per batch row `b` and KV head `h`: `kept[b][h]`, the retained absolute positions, and
    `store[b][h][t] = (key, value)` for every position ever fed (the reference never forgets a
    row, it only marks it evicted).

    After each `feed`:
      - `last_visible[b][h][i]`: sorted positions query `i` of the call attended to (KV head `h`).
      - `min_margin`: the smallest relative gap, over all eviction decisions so far, between the
        last evicted weight and the first kept non-sink weight. Tests skip examples where it is
        so small that fp32 rounding could flip the decision.
    """

    def __init__(
        self,
        budget: int,
        n_sink: int,
        signal: str,
        scope: str,
        prefill: str,
        allocation: str = "uniform",
        allocation_floor: float = 0.2,
    ) -> None:
        # the uniform cut (head allocation has its own reference: test_tova_allocation.py)
        assert allocation == "uniform" and 0 <= allocation_floor <= 1
        assert signal in SIGNALS and scope in SCOPES and prefill in PREFILLS
        assert 0 <= n_sink < budget
        self.budget = budget
        self.n_sink = n_sink
        # positions never evicted besides the sinks (pinned spans); set by a test
        self.pinned: set[int] = set()
        self.signal = signal
        self.scope = scope
        self.prefill = prefill
        self.offset = 0
        self.kept: list[list[list[int]]] | None = None
        self.store: list[list[dict[int, tuple[np.ndarray, np.ndarray]]]] = []
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
        if scale is None:
            scale = 1.0 / math.sqrt(dim)
        if self.kept is None:
            self.kept = [[[] for _ in range(n_kv)] for _ in range(n_batch)]
            self.store = [[{} for _ in range(n_kv)] for _ in range(n_batch)]

        for b in range(n_batch):
            for h in range(n_kv):
                for i in range(length):
                    self.store[b][h][self.offset + i] = (keys[b, h, i], values[b, h, i])

        self.last_visible = [
            [[[] for _ in range(length)] for _ in range(n_kv)] for _ in range(n_batch)
        ]
        for b in range(n_batch):
            if self.prefill == "sequential" or length == 1:
                self._sequential(b, length, keys, queries, scale)
            else:
                self._oneshot(b, length, keys, queries, scale)

        outputs = None
        if queries is not None:
            outputs = self._outputs(queries, scale, n_kv, length, dim)
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

    # -------------------------------------------------------------- decisions

    def _sequential(
        self,
        b: int,
        length: int,
        keys: np.ndarray,
        queries: np.ndarray | None,
        scale: float,
    ) -> None:
        assert self.kept is not None
        n_kv = len(self.kept[b])
        for i in range(length):
            t = self.offset + i
            candidates = [self.kept[b][h] + [t] for h in range(n_kv)]
            for h in range(n_kv):
                self.last_visible[b][h][i] = sorted(candidates[h])
            if len(candidates[0]) > self.budget:
                weights = self._weights(b, candidates, keys, queries, i, scale)
                for h in range(n_kv):
                    evicted = self._lowest(weights[h], 1)
                    candidates[h] = [p for p in candidates[h] if p not in evicted]
            self.kept[b] = candidates

    def _oneshot(
        self,
        b: int,
        length: int,
        keys: np.ndarray,
        queries: np.ndarray | None,
        scale: float,
    ) -> None:
        assert self.kept is not None
        n_kv = len(self.kept[b])
        chunk = [self.offset + i for i in range(length)]
        for h in range(n_kv):
            for i in range(length):
                self.last_visible[b][h][i] = sorted(self.kept[b][h] + chunk[: i + 1])
        candidates = [self.kept[b][h] + chunk for h in range(n_kv)]
        n = len(candidates[0])
        if n > self.budget:
            # Weights of the chunk's last query row, which sees every candidate.
            weights = self._weights(b, candidates, keys, queries, length - 1, scale)
            for h in range(n_kv):
                evicted = self._lowest(weights[h], n - self.budget)
                candidates[h] = [p for p in candidates[h] if p not in evicted]
        self.kept[b] = candidates

    def _weights(
        self,
        b: int,
        candidates: list[list[int]],
        keys: np.ndarray,
        queries: np.ndarray | None,
        i: int,
        scale: float,
    ) -> list[dict[int, float]]:
        """Per KV head: {position: weight} over that head's candidates, for the call's token i."""
        n_kv = len(candidates)
        # One softmax row per signal head, tagged with the KV head whose keys it reads.
        rows: list[tuple[int, dict[int, float]]] = []
        if self.signal == "query":
            assert queries is not None
            group = queries.shape[1] // n_kv
            for qh in range(queries.shape[1]):
                rows.append(
                    (
                        qh // group,
                        self._softmax_row(
                            b, qh // group, queries[b, qh, i], candidates[qh // group], scale
                        ),
                    )
                )
        else:
            for h in range(n_kv):
                rows.append((h, self._softmax_row(b, h, keys[b, h, i], candidates[h], scale)))

        weights: list[dict[int, float]] = []
        for h in range(n_kv):
            if self.scope == "layer":
                used = [row for _, row in rows]
            else:
                used = [row for owner, row in rows if owner == h]
            weights.append({p: sum(row[p] for row in used) / len(used) for p in candidates[h]})
        return weights

    def _softmax_row(
        self, b: int, h: int, q: np.ndarray, positions: list[int], scale: float
    ) -> dict[int, float]:
        logits = np.array([q @ self.store[b][h][p][0] * scale for p in positions])
        probs = softmax(logits)
        return {p: float(w) for p, w in zip(positions, probs, strict=True)}

    def _lowest(self, weights: dict[int, float], count: int) -> set[int]:
        """The `count` lowest-weight non-sinks; equal weights evict the lower position first."""
        order = sorted(
            (w, p) for p, w in weights.items() if p >= self.n_sink and p not in self.pinned
        )
        assert len(order) >= count
        if len(order) > count:
            last_out, first_in = order[count - 1][0], order[count][0]
            gap = (first_in - last_out) / max(abs(first_in), abs(last_out), 1e-300)
            self.min_margin = min(self.min_margin, gap)
        return {p for _, p in order[:count]}

    # ---------------------------------------------------------------- outputs

    def _outputs(
        self, queries: np.ndarray, scale: float, n_kv: int, length: int, dim: int
    ) -> np.ndarray:
        n_batch, n_q = queries.shape[:2]
        group = n_q // n_kv
        outputs = np.zeros((n_batch, n_q, length, dim))
        for b in range(n_batch):
            for qh in range(n_q):
                h = qh // group
                for i in range(length):
                    visible = self.last_visible[b][h][i]
                    probs = softmax(
                        np.array(
                            [queries[b, qh, i] @ self.store[b][h][p][0] * scale for p in visible]
                        )
                    )
                    for p, w in zip(visible, probs, strict=True):
                        outputs[b, qh, i] += w * self.store[b][h][p][1]
        return outputs
