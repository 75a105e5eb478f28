"""GGUF files whose K-quant tensors (Q4_K, Q6_K, ...) have no MLX layout: Gemma 3 270M and
Qwen2.5-Coder-1.5B.

MLX's own reader (``mx.load``) takes only Q4_0/Q4_1/Q8_0, so each tensor is dequantized with
``gguf.quants.dequantize`` (numpy) and handed to MLX as a plain array in mlx-lm's ``[out, in]``
layout (the reverse of the shape GGUF lists). Needs ``pip install gguf``.

The header is read here (:func:`read_gguf`), not by ``gguf.GGUFReader``: that reader builds a
NumPy view per part of every metadata value, which for a vocabulary of 150k-260k tokens took
most of a model's load (about 12 s of Qwen2.5-Coder's, 15-30 s of Gemma 3's, 2 cores).
Here the metadata is unpacked from one bytes object, and each tensor is a view of the mapped
file laid out as ``GGUFReader`` lays it out, so ``dequantize`` takes it as it is
(``tests/test_gguf_reader.py`` checks both readers agree).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GgufFile",
    "GgufTensor",
    "architecture",
    "field",
    "read_gguf",
    "tensors",
    "tokenizer_metadata",
]


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: its GGUF name, ``gguf.GGMLQuantizationType``, GGUF shape (innermost
    first) and data, a view of the file as ``gguf.GGUFReader`` gives it (elements for plain
    types, ``[..., bytes per row]`` uint8 for quantized ones)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's metadata (``fields``: key -> str, int, float, bool or list) and tensors."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GgufTensor]


def read_gguf(path: str | Path, architecture: str) -> GgufFile:
    """``path`` read (metadata, tensor views): ``FileNotFoundError`` for a missing file,
    ``ValueError`` for a file that is not GGUF v2/v3 or whose ``general.architecture`` is not
    ``architecture``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    gguf = _read(path)
    arch = gguf.fields.get("general.architecture")
    if arch != architecture:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}: only {architecture!r}")
    return gguf


def field(reader: GgufFile, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or list)."""
    return reader.fields.get(key, default)


def tensors(
    reader: GgufFile, rename: Callable[[str], str]
) -> Iterator[tuple[str, str, np.ndarray]]:
    """Each tensor as ``(gguf name, mlx-lm name, float32 array [out, in])``, dequantized one at
    a time so only one float copy of a tensor is alive beside what the caller keeps."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        value = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        yield tensor.name, rename(tensor.name), value


def tokenizer_metadata(reader: GgufFile) -> dict[str, Any]:
    """Every ``tokenizer.*`` field under its GGUF key, as :func:`load_gguf_tokenizer
    <velox_mlx_lm.embedded.tokenizer.load_gguf_tokenizer>` reads them."""
    return {key: value for key, value in reader.fields.items() if key.startswith("tokenizer.")}


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip


def architecture(path: str | Path) -> str | None:
    """``general.architecture`` of a GGUF file, read from its header alone (no ``gguf``
    package, no tensor read); ``None`` when the header has none. ``ValueError`` for a file
    that is not GGUF (v2 or v3)."""
    _, c, _, n_keys = _open(Path(path))
    for _ in range(n_keys):
        key, kind = c.string(), c.scalar(4)
        if key == "general.architecture" and kind == 8:
            return c.string()
        c.skip(kind)
    return None


_SIZES = {kind: struct.calcsize("<" + fmt) for kind, fmt in _SCALARS.items()}


class _Cursor:
    """Reads little-endian GGUF values from ``buf`` from offset ``at`` on."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def scalar(self, kind: int) -> Any:
        (value,) = struct.unpack_from("<" + _SCALARS[kind], self.buf, self.at)
        self.at += _SIZES[kind]
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.at)
        start = self.at + 8
        self.at = start + n
        return str(self.buf[start : self.at], "utf-8")

    def skip(self, kind: int) -> None:
        """Move past a value of ``kind`` without building it."""
        if kind in _SCALARS:
            self.at += _SIZES[kind]
        elif kind == 8:
            self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", self.buf, self.at)
            self.at += 12
            if item in _SCALARS:
                self.at += count * _SIZES[item]
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind}")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", self.buf, self.at)
            self.at += 12
            if item in _SCALARS:  # one NumPy read of the whole array
                dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
                values = np.frombuffer(self.buf, dtype, count, self.at)
                self.at += values.nbytes
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata type {kind}")


# tensor types whose data GGUFReader gives as elements (the others: bytes per row)
_ELEMENTS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8}
_ELEMENTS |= {"I16": np.int16, "I32": np.int32, "I64": np.int64}


def _open(path: Path) -> tuple[np.memmap, _Cursor, int, int]:
    """The file mapped, a cursor past its header's counts, its tensor and key counts;
    ``ValueError`` for a file that is not GGUF v2/v3."""
    if path.stat().st_size < 24:  # shorter than the header (and too short to map if empty)
        raise ValueError(f"{path} is not a GGUF file")
    data = np.memmap(path, mode="r")
    c = _Cursor(data.data)
    if bytes(c.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    c.at = 4
    version, n_tensors, n_keys = c.scalar(4), c.scalar(10), c.scalar(10)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}, only 2 and 3 are read")
    return data, c, n_tensors, n_keys


def _read(path: Path) -> GgufFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    data, c, n_tensors, n_keys = _open(path)
    fields: dict[str, Any] = {}
    for _ in range(n_keys):
        key = c.string()
        fields[key] = c.value(c.scalar(4))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar(10) for _ in range(c.scalar(4)))
        infos.append((name, dims, c.scalar(4), c.scalar(10)))
    alignment = fields.get("general.alignment", 32)
    start = -(-c.at // alignment) * alignment
    found = []
    for name, dims, raw_type, offset in infos:
        kind = GGMLQuantizationType(raw_type)
        n = int(np.prod(dims))
        shape: tuple[int, ...] = tuple(reversed(dims))
        dtype = _ELEMENTS.get(kind.name)
        if dtype is None:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, n = np.uint8, n * size // block
            shape = quant_shape_to_byte_shape(shape, kind)
        view = np.frombuffer(data, dtype, n, start + offset).reshape(shape)
        found.append(GgufTensor(name, kind, dims, view))
    return GgufFile(path, fields, found)
