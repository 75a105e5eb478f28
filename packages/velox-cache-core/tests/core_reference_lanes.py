"""Plain references for adaptive allocation (velox_cache_core.lanes): row order per head and
the shares every head gets."""

from __future__ import annotations

import numpy as np


def order(scores: np.ndarray, positions: np.ndarray, protected: np.ndarray) -> list[int]:
    """Row indices best first: protected, then score, ties won by the newer."""
    return sorted(
        range(len(scores)),
        key=lambda i: (not protected[i], -np.inf if protected[i] else -scores[i], -positions[i]),
    )


def ref_shares(scores, positions, protected, total, least, width):  # type: ignore[no-untyped-def]
    B, H, n = scores.shape
    cap = width * (n // width)
    total = min(total, H * cap)
    least = min(least, width * (total // H // width))
    out = np.zeros((B, H), dtype=np.int64)
    for b in range(B):
        pool = []
        for h in range(H):
            best = order(scores[b, h], positions[b, h], protected[b, h])
            pool += [(scores[b, h, i], positions[b, h, i], h) for i in best[least:]]
        k = max(0, total - H * least)
        pool.sort(key=lambda t: (-t[0], -t[1], -t[2]))
        counts = np.full(H, least)
        for _, _, h in pool[:k]:
            counts[h] += 1
        counts = np.clip(counts, least, cap)
        lanes = counts // width
        rest = counts - lanes * width
        free = total // width - lanes.sum()
        for h in sorted(range(H), key=lambda h: -rest[h]):
            if free > 0 and (lanes[h] + 1) * width <= cap:
                lanes[h] += 1
                free -= 1
        out[b] = lanes * width
    return out


def reference_lanes_keep(scores, positions, protected, total, least, width):  # type: ignore[no-untyped-def]
    """Kept row indices per (b, head), ascending: each head's best ``ref_shares`` rows."""
    counts = ref_shares(scores, positions, protected, total, least, width)
    B, H, _ = scores.shape
    return [
        [
            sorted(order(scores[b, h], positions[b, h], protected[b, h])[: counts[b, h]])
            for h in range(H)
        ]
        for b in range(B)
    ]
