"""A tiny random qwen2 GGUF: the Qwen2.5-Coder loader, tokenizer and tool-call wiring, without
the 1.1 GB model (CI's tests and ``python -m velox_bench.instrument --quick``).

Same metadata keys, tensor names, tokenizer fields and chat template as the real file
(Qwen's template, ``data/qwen2_chat_template.jinja``); a byte-level vocabulary of the 256 byte
symbols plus a few merges, and the real file's control and user-defined tokens. Matrices are
stored as Q8_0 (the ``gguf`` package quantizes no K-quant), vectors as F32; biases on q/k/v and
a separate ``output.weight`` as in the real file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np

__all__ = ["SPECIAL", "write_tiny_qwen2_gguf"]

# (token, llama.cpp type): 3 control, 4 user-defined, as in Qwen2.5-Coder's file
SPECIAL = (
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
)
_MERGE_TEXT = "the pass key of def return self import print string reverse function"


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode table, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _vocab() -> tuple[list[str], list[str]]:
    """Tokens (bytes, then merged pieces) and merges ``"a b"``, learned greedily on a short text."""
    symbols = _byte_symbols()
    tokens, merges = list(symbols), []
    for word in _MERGE_TEXT.split():
        pieces = [symbols[b] for b in (" " + word).encode()]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            if merged not in tokens:
                tokens.append(merged)
                merges.append(f"{pieces[0]} {pieces[1]}")
            pieces = [merged, *pieces[2:]]
    return tokens, merges


def write_tiny_qwen2_gguf(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    context: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a random qwen2 GGUF at ``path`` and return it (a few hundred KB)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, merges = _vocab()
    tokens += [t for t, _ in SPECIAL]
    types = [1] * (len(tokens) - len(SPECIAL)) + [ty for _, ty in SPECIAL]
    vocab = len(tokens)
    head_dim = hidden // heads
    template = resources.files(__package__).joinpath("data").joinpath("qwen2_chat_template.jinja")

    writer = GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(template.read_text(encoding="utf-8"))

    def matrix(name: str, out_dim: int, in_dim: int) -> None:
        value = (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)
        q = quantize(value, GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    def vector(name: str, size: int, scale: float = 0.1, base: float = 0.0) -> None:
        writer.add_tensor(name, (base + scale * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    matrix("output.weight", vocab, hidden)
    vector("output_norm.weight", hidden, base=1.0)
    for i in range(layers):
        block = f"blk.{i}"
        vector(f"{block}.attn_norm.weight", hidden, base=1.0)
        vector(f"{block}.ffn_norm.weight", hidden, base=1.0)
        matrix(f"{block}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"{block}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"{block}.attn_v.weight", kv_heads * head_dim, hidden)
        vector(f"{block}.attn_q.bias", heads * head_dim)
        vector(f"{block}.attn_k.bias", kv_heads * head_dim)
        vector(f"{block}.attn_v.bias", kv_heads * head_dim)
        matrix(f"{block}.attn_output.weight", hidden, heads * head_dim)
        matrix(f"{block}.ffn_gate.weight", ffn, hidden)
        matrix(f"{block}.ffn_up.weight", ffn, hidden)
        matrix(f"{block}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
