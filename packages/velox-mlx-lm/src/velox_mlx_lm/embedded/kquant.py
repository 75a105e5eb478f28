"""GGUF files read through the ``gguf`` package, for the models whose K-quant tensors (Q4_K,
Q6_K, ...) have no MLX layout: Gemma 3 270M and Qwen2.5-Coder-1.5B.

MLX's own reader (``mx.load``) takes only Q4_0/Q4_1/Q8_0, so each tensor is dequantized with
``gguf.quants.dequantize`` (numpy) and handed to MLX as a plain array in mlx-lm's ``[out, in]``
layout (the reverse of the shape GGUF lists). Needs ``pip install gguf``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["architecture", "field", "read_gguf", "tensors", "tokenizer_metadata"]


def read_gguf(path: str | Path, architecture: str) -> Any:
    """A ``gguf.GGUFReader`` over ``path``: ``FileNotFoundError`` for a missing file,
    ``ValueError`` for a file whose ``general.architecture`` is not ``architecture``."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFReader(path)
    arch = field(reader, "general.architecture")
    if arch != architecture:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}: only {architecture!r}")
    return reader


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or list)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def tensors(reader: Any, rename: Callable[[str], str]) -> Iterator[tuple[str, str, np.ndarray]]:
    """Each tensor as ``(gguf name, mlx-lm name, float32 array [out, in])``, dequantized one at
    a time so only one float copy of a tensor is alive beside what the caller keeps."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        value = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        yield tensor.name, rename(tensor.name), value


def tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """Every ``tokenizer.*`` field under its GGUF key, as :func:`load_gguf_tokenizer
    <velox_mlx_lm.embedded.tokenizer.load_gguf_tokenizer>` reads them."""
    return {key: field(reader, key) for key in reader.fields if key.startswith("tokenizer.")}


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize("<" + _SCALARS[kind]), 1)
    elif kind == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF metadata type {kind}")


def architecture(path: str | Path) -> str | None:
    """``general.architecture`` of a GGUF file, read from its header alone (no ``gguf``
    package, no tensor read); ``None`` when the header has none. ``ValueError`` for a file
    that is not GGUF (v2 or v3)."""
    with Path(path).open("rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        _, n_keys = struct.unpack("<QQ", f.read(16))
        for _ in range(n_keys):
            (n,) = struct.unpack("<Q", f.read(8))
            key = f.read(n).decode("utf-8")
            (kind,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == 8:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n).decode("utf-8")
            _skip_value(f, kind)
    return None
