"""Where one TOVA decode update spends its time, next to one SDPA call over the same keys.

    python -m velox_bench.probes.profile_decode

Budget 512, B=1, H_kv 8, H_q 32, D 128, float32: medians of the cumulative stages (query-key
logits, + softmax/mean, + victim selection) and of the whole ``tova_update``, evaluated.
"""

# ruff: noqa: E402  (OpenBLAS must be loaded before mlx is imported, see below)

from __future__ import annotations

# velox_blas imports no mlx: OpenBLAS (Linux, when present) is loaded before mlx below.
import velox_blas

BLAS = velox_blas.preload_openblas()

import time
from collections.abc import Callable

import mlx.core as mx

from velox_cache_core import init_tova_state, tova_update
from velox_cache_core.scoring import decision_weights, grouped_logits
from velox_cache_core.selection import lowest_weight

B, H, HQ, D, N = 1, 8, 32, 128, 513


def median_ms(f: Callable[[], object], rounds: int = 60) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    keys, values = mx.random.normal((B, H, N, D)), mx.random.normal((B, H, N, D))
    query = mx.random.normal((B, HQ, 1, D))
    positions = mx.broadcast_to(mx.arange(N, dtype=mx.int32)[None, None], (B, 1, N))
    mx.eval(keys, values, query, positions)
    scale = D**-0.5

    def weights() -> mx.array:
        return decision_weights(grouped_logits(query, keys, scale, "layer"))

    sdpa = median_ms(
        lambda: mx.eval(mx.fast.scaled_dot_product_attention(query, keys, values, scale=scale))
    )
    logits = median_ms(lambda: mx.eval(grouped_logits(query, keys, scale, "layer")))
    softmax = median_ms(lambda: mx.eval(weights()))
    victim = median_ms(lambda: mx.eval(lowest_weight(weights()[:, :, 0], positions, positions < 4)))

    state = init_tova_state(budget=512, n_sink=4)
    pk, pv, pq = (mx.random.normal((B, h, 520, D)) for h in (H, H, HQ))
    box = [tova_update(state, pk, pv, pq).state]
    new = mx.random.normal((B, H, 1, D))
    mx.eval(*box[0].slots.arrays(), new)

    def update() -> None:
        step = tova_update(box.pop(), new, new, query, check_finite=False)
        box.append(step.state)  # the old state is dropped first, so the slot write is in place
        mx.eval(step.keys, step.values, *step.state.slots.arrays())

    whole = median_ms(update)
    print(f"BLAS: {BLAS}")
    print(f"SDPA over {N} keys            {sdpa:7.3f} ms  1.00")
    for label, t in (
        ("logits (32 heads)", logits),
        ("+ softmax and mean", softmax),
        ("+ victim selection", victim),
        ("whole tova_update", whole),
    ):
        print(f"{label:<28}{t:7.3f} ms  {t / sdpa:.2f}")


if __name__ == "__main__":
    main()
