"""Load the weights of a llama-architecture GGUF file into ``mlx_lm.models.llama``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

__all__ = ["load_gguf_model", "metadata_scalar"]

# GGUF block tensor -> mlx_lm llama module.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GROUP_SIZE = 32  # mx.load maps Q4_0/Q4_1 to 4-bit and Q8_0 to 8-bit affine, group size 32


def metadata_scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A GGUF metadata value as a Python scalar (``mx.load`` returns numbers as 0-d arrays)."""
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _module_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    m = re.fullmatch(r"(\w+)\.(weight|scales|biases)", gguf_name)
    if m and m[1] in _TOP_NAMES:
        return f"{_TOP_NAMES[m[1]]}.{m[2]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for the llama architecture")


def _model_args(metadata: dict[str, Any], tied: bool) -> llama.ModelArgs:
    def get(key: str, default: Any = None) -> Any:
        return metadata_scalar(metadata, "llama." + key, default)

    n_heads = get("attention.head_count")
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=get("embedding_length"),
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=get("vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        max_position_embeddings=get("context_length"),
        rope_theta=get("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes HF Q/K rows into the interleaved (GPT-J) RoPE layout;
        # traditional RoPE uses them as stored. False still "works" at ~10x the perplexity.
        rope_traditional=True,
        tie_word_embeddings=tied,
    )


def _bits(weights: dict[str, mx.array], prefix: str) -> int:
    """Bits per weight of a quantized tensor: packed uint32 columns vs. scale groups."""
    packed = weights[f"{prefix}.weight"].shape[-1]
    in_dim = weights[f"{prefix}.scales"].shape[-1] * _GROUP_SIZE
    bits = packed * 32 // in_dim
    if bits not in (4, 8):
        raise ValueError(f"unsupported quantization of {prefix!r}: {bits} bits")
    return int(bits)


def load_gguf_model(
    path: str | Path,
    dequantize: bool = True,
    dtype: mx.Dtype = mx.float32,
) -> tuple[llama.Model, dict[str, Any]]:
    """Build an ``mlx_lm`` llama model from a GGUF file; return it with the GGUF metadata.

    Q4_0/Q4_1 tensors become MLX affine 4-bit (group 32), Q8_0 8-bit, F16/F32 stay plain.
    ``dequantize=True`` expands quantized layers to ``dtype`` (plain ``Linear``, fast with a real
    BLAS); ``False`` keeps them as ``QuantizedLinear``/``QuantizedEmbedding`` with ``dtype``
    scales.
    """
    path = Path(path)
    weights, metadata = _read_weights(path, dtype)
    model = llama.Model(_model_args(metadata, tied="lm_head.weight" not in weights))
    quantized = {k[: -len(".weight")] for k, v in weights.items() if v.dtype == mx.uint32}
    for prefix in quantized:
        if f"{prefix}.scales" not in weights or f"{prefix}.biases" not in weights:
            raise ValueError(f"unsupported GGUF tensor type for {prefix!r} in {path}")
    bits = {prefix: _bits(weights, prefix) for prefix in quantized}
    if dequantize:
        _dequantize(weights, bits, dtype)
    else:
        nn.quantize(
            model,
            class_predicate=lambda p, _: p in bits and {"group_size": _GROUP_SIZE, "bits": bits[p]},
        )
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, metadata


def _read_weights(path: Path, dtype: mx.Dtype) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """A llama GGUF's tensors under mlx-lm's names (float ones as ``dtype``) and metadata."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        raw, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:  # e.g. a tensor type mlx cannot read
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    assert isinstance(raw, dict) and isinstance(metadata, dict)
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}: only 'llama'")
    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        if not (value.dtype == mx.uint32 or mx.issubdtype(value.dtype, mx.floating)):
            raise ValueError(f"unsupported GGUF tensor type {value.dtype} for {name!r} in {path}")
        # fp16 scales/biases/norms -> dtype: half-precision activations are very slow on CPU.
        floating = mx.issubdtype(value.dtype, mx.floating)
        weights[_module_name(name)] = value.astype(dtype) if floating else value
    return weights, metadata


def _dequantize(weights: dict[str, mx.array], bits: dict[str, int], dtype: mx.Dtype) -> None:
    """Expand each quantized layer's packed weight, scales and biases to ``dtype``."""
    for prefix, width in bits.items():
        weights[f"{prefix}.weight"] = mx.dequantize(
            weights[f"{prefix}.weight"],
            weights.pop(f"{prefix}.scales"),
            weights.pop(f"{prefix}.biases"),
            group_size=_GROUP_SIZE,
            bits=width,
        ).astype(dtype)
