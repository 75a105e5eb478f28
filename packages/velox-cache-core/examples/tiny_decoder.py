"""A tiny hand-written MLX decoder that evicts its KV cache with velox-cache-core's TOVA.

No mlx-lm: embeddings, RoPE, GQA attention, RMSNorm, SwiGLU MLP and an LM head, written out so
the one call to ``tova_update`` at the attention site is easy to find. Each layer carries one
``TovaState`` (or, for comparison, a plain growing ``FullCache``); a forward pass takes the
per-layer caches and returns the logits with the next caches.

    python packages/velox-cache-core/examples/tiny_decoder.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from velox_cache_core import TovaState, init_tova_state, tova_update


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class FullCache:
    """No eviction: keys/values ``[B, H_kv, offset, D]`` grow by every call."""

    keys: mx.array | None = None
    values: mx.array | None = None

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def arrays(self) -> list[mx.array]:
        return [] if self.keys is None or self.values is None else [self.keys, self.values]


Cache = TovaState | FullCache


def attention_mask(mask: mx.array | None, n_heads: int) -> mx.array | None:
    """A Velox mask ``[B, 1 | H_kv | H_q, L, n]`` made broadcastable to ``n_heads`` query heads."""
    if mask is None or mask.shape[1] in (1, n_heads):
        return mask
    # One row per KV head: repeat it over that head's query group.
    return mx.repeat(mask, n_heads // mask.shape[1], axis=1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.rope_theta = args.rope_theta
        self.scale = 1.0 / math.sqrt(args.head_dim)
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def __call__(self, x: mx.array, cache: Cache) -> tuple[mx.array, Cache]:
        B, L, _ = x.shape

        def heads(y: mx.array, n: int) -> mx.array:
            return y.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

        q = heads(self.q_proj(x), self.n_heads)
        k = heads(self.k_proj(x), self.n_kv_heads)
        v = heads(self.v_proj(x), self.n_kv_heads)
        # The true position of the first new token: tokens seen, never the rows retained.
        rope = {"traditional": False, "base": self.rope_theta, "scale": 1.0, "offset": cache.offset}
        q = mx.fast.rope(q, self.head_dim, **rope)
        k = mx.fast.rope(k, self.head_dim, **rope)

        mask: mx.array | str | None
        if isinstance(cache, TovaState):
            # Signal "key" needs no queries; the mask may then come back per KV head.
            queries = q if cache.signal == "query" else None
            step = tova_update(cache, k, v, queries, scale=self.scale, check_finite=False)
            keys, values, cache = step.keys, step.values, step.state
            mask = attention_mask(step.mask, self.n_heads)
        else:
            if cache.keys is not None and cache.values is not None:
                k = mx.concatenate([cache.keys, k], axis=2)
                v = mx.concatenate([cache.values, v], axis=2)
            keys, values, cache = k, v, FullCache(k, v)
            mask = "causal" if L > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1)), cache


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.mlp_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def __call__(self, x: mx.array, cache: Cache) -> tuple[mx.array, Cache]:
        h, cache = self.attention(self.attention_norm(x), cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = [Block(args) for _ in range(args.n_layers)]
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, caches: list[Cache]) -> tuple[mx.array, list[Cache]]:
        """tokens: int ``[B, L]``; one cache per layer. Returns logits ``[B, L, vocab]``."""
        x = self.embed_tokens(tokens)
        next_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cache)
            next_caches.append(cache)
        return self.lm_head(self.norm(x)), next_caches


def make_caches(args: ModelArgs, budget: int | None, **settings: Any) -> list[Cache]:
    """One empty cache per layer: ``TovaState`` at ``budget``, or ``FullCache`` for ``None``."""
    if budget is None:
        return [FullCache() for _ in range(args.n_layers)]
    return [init_tova_state(budget=budget, **settings) for _ in range(args.n_layers)]


def cache_arrays(caches: list[Cache]) -> list[mx.array]:
    """Every array the caches hold, to ``mx.eval`` with the logits (keeps graphs bounded)."""
    out: list[mx.array] = []
    for cache in caches:
        if isinstance(cache, FullCache):
            out += cache.arrays()
        elif cache.slots is not None:
            out += cache.slots.arrays()
    return out


def run(
    model: Model, tokens: mx.array, chunks: list[int], caches: list[Cache]
) -> tuple[mx.array, list[Cache]]:
    """Feed ``tokens`` ``[B, S]`` in chunks of the given lengths; logits ``[B, S, vocab]``."""
    assert sum(chunks) == tokens.shape[1], "chunk lengths must add up to the sequence length"
    logits, start = [], 0
    for length in chunks:
        out, caches = model(tokens[:, start : start + length], caches)
        # `caches` now names only the new states, so a decode step's slot write can be in place.
        mx.eval(out, *cache_arrays(caches))
        logits.append(out)
        start += length
    return mx.concatenate(logits, axis=1), caches


def main() -> None:
    mx.random.seed(0)
    args = ModelArgs()
    model = Model(args)
    mx.eval(model.parameters())
    prompt, decode, budget = 192, 32, 48
    tokens = mx.random.randint(0, args.vocab_size, (1, prompt + decode))
    chunks = [64] * (prompt // 64) + [1] * decode
    logits, caches = run(model, tokens, chunks, make_caches(args, budget, n_sink=4))
    full_logits, _ = run(model, tokens, chunks, make_caches(args, None))

    for i, cache in enumerate(caches):
        assert isinstance(cache, TovaState) and cache.positions is not None
        kept = sorted(cache.positions[0, 0].tolist())
        print(f"layer {i}: kept {cache.n_kept} of {cache.offset} tokens, positions {kept}")
        print(f"layer {i}: compression ratio {cache.compression_ratio:.2f}")
    gap = mx.abs(logits - full_logits).max().item()
    print(f"max |logits - full-cache logits| over the stream: {gap:.3g}")


if __name__ == "__main__":
    main()
