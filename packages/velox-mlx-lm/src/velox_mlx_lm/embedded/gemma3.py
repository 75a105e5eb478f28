"""Load a Gemma 3 GGUF (K-quants) into ``mlx_lm.models.gemma3_text`` through the ``gguf`` package.

MLX's own GGUF reader takes only Q4_0/Q4_1/Q8_0; Gemma 3 270M's file also holds Q5_0, Q4_K and
Q6_K tensors, so every tensor is dequantized by ``gguf.quants.dequantize`` (numpy) and loaded as
a plain ``dtype`` layer. Conventions of llama.cpp's converter (``Gemma3Model`` in
``convert_hf_to_gguf.py``), undone here:

- every ``*norm.weight`` is stored as ``1 + w`` (Gemma's RMSNorm scales by ``1 + w``, and
  llama.cpp's by the stored weight); mlx-lm's ``RMSNorm`` adds the 1 itself, so it is taken off;
- q/k rows are not permuted (only llama's converter permutes them), so RoPE stays mlx-lm's
  non-traditional (half-split) layout, as in the Hugging Face checkpoint.

The file has no ``sliding_window_pattern``: which layers are global (every 6th) and the local
RoPE base (10,000) come from mlx-lm's ``gemma3_text.ModelArgs`` defaults.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import gemma3_text
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, TokenizerWrapper

from . import kquant
from .kquant import field

__all__ = ["field", "load_gemma3_gguf", "read_gguf"]

ARCHITECTURE = "gemma3"
# GGUF block tensor -> mlx_lm gemma3_text module.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def read_gguf(path: str | Path) -> kquant.GgufFile:
    """A gemma3 GGUF's metadata and tensor views (:func:`velox_mlx_lm.embedded.kquant.read_gguf`:
    ``FileNotFoundError`` for a missing file, ``ValueError`` for a file of another
    architecture)."""
    return kquant.read_gguf(path, ARCHITECTURE)


def module_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m[1] in _TOP_NAMES:
        return f"{_TOP_NAMES[m[1]]}.weight"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for the gemma3 architecture")


def model_args(reader: Any) -> gemma3_text.ModelArgs:
    """mlx-lm's arguments from the file's ``gemma3.*`` keys; the rest are mlx-lm's defaults."""

    def get(key: str) -> Any:
        value = field(reader, f"{ARCHITECTURE}.{key}")
        if value is None:
            raise ValueError(f"the GGUF file has no {ARCHITECTURE}.{key}")
        return value

    if field(reader, f"{ARCHITECTURE}.rope.scaling.type") not in (None, "none"):
        raise ValueError("RoPE scaling in a gemma3 GGUF is not supported by this loader")
    head_dim = get("attention.key_length")
    return gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=get("embedding_length"),
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count_kv"),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=len(field(reader, "tokenizer.ggml.tokens")),
        rope_theta=get("rope.freq_base"),
        # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 but the 27B
        query_pre_attn_scalar=head_dim,
        sliding_window=get("attention.sliding_window"),
        max_position_embeddings=get("context_length"),
    )


def weights(reader: Any, dtype: mx.Dtype = mx.float32) -> dict[str, mx.array]:
    """Every tensor dequantized to ``dtype`` under mlx-lm's name, norms as mlx-lm stores them."""
    out: dict[str, mx.array] = {}
    for gguf_name, name, value in kquant.tensors(reader, module_name):
        if gguf_name.endswith("norm.weight"):
            value = value - 1.0  # stored as 1 + w by llama.cpp's converter
        out[name] = mx.array(value).astype(dtype)
    return out


def load_model(reader: Any, dtype: mx.Dtype = mx.float32) -> gemma3_text.Model:
    model = gemma3_text.Model(model_args(reader))
    loaded = model.sanitize(weights(reader, dtype))  # drops lm_head when the file ties it
    model.load_weights(list(loaded.items()), strict=True)
    mx.eval(model.parameters())
    return model


def load_tokenizer(reader: Any) -> TokenizerWrapper:
    """The file's SentencePiece vocabulary as transformers rebuilds it without torch
    (``convert_gguf_tokenizer``), with ``<bos>`` prepended when the file says to."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    found = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        value = field(reader, f"tokenizer.{key}")
        if value is not None:
            found[name] = value
    tokenizer, _ = convert_gguf_tokenizer(ARCHITECTURE, found)
    tokens = found["tokens"]

    def token(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    bos = token("bos")
    if bos is not None and field(reader, "tokenizer.ggml.add_bos_token", False):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=field(reader, "tokenizer.chat_template"),
    )
    # Gemma's decoder keeps a leading space (no Strip step), as mlx-lm's own loader decides
    return TokenizerWrapper(hf, partial(SPMStreamingDetokenizer, trim_space=False))


def load_gemma3_gguf(
    path: str | Path, dtype: mx.Dtype = mx.float32
) -> tuple[gemma3_text.Model, TokenizerWrapper]:
    """A Gemma 3 GGUF as an ``mlx_lm`` ``gemma3_text`` model (dequantized to ``dtype``) and
    its tokenizer. Needs ``pip install velox-mlx-lm[gemma]`` (the ``gguf`` package)."""
    reader = read_gguf(path)
    return load_model(reader, dtype), load_tokenizer(reader)
