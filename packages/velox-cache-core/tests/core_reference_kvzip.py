"""Plain numpy reference for KVzip with ``probe="latest"`` (the contract matrix's entry): nothing
is evicted while the context is fed; ``compress`` keeps, per (b, KV head), the sinks and the
``budget - n_sink`` positions the last context probe row weighs most (its softmax over the
context, averaged over the KV head's GQA group); later tokens are appended, never evicted.
The reconstruction probe is checked against its own reference in test_kvzip.py.
"""

from __future__ import annotations

from core_reference_siblings import SIGNALS, _Reference


class ReferenceKVzip(_Reference):
    scope = "head"

    def __init__(
        self,
        budget: int,
        n_sink: int,
        probe: str,
        signal: str,
        after: str,
        allocation: str,
        allocation_floor: float,
    ) -> None:
        super().__init__(budget, n_sink)
        # The latest probe always cuts per head, whatever the allocation (which shares out the
        # reconstruction scores).
        assert probe == "latest" and after == "append" and signal in SIGNALS
        assert allocation in ("uniform", "head", "global") and 0 <= allocation_floor <= 1
        self.signal = signal
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
        n = self.offset
        for b in range(len(self.kept)):
            weights = self._row_weights(b, [list(range(n)) for _ in range(self.n_kv)], n - 1)
            for h in range(self.n_kv):
                evictable = {
                    p: w for p, w in weights[h].items() if p >= self.n_sink and p not in self.pinned
                }
                gone = self._lowest(evictable, n - self.budget)
                self.kept[b][h] = [p for p in range(n) if p not in gone]
