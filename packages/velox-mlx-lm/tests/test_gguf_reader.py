"""``velox_mlx_lm.embedded.kquant.read_gguf`` against ``gguf.GGUFReader``: the same metadata
values and the same tensor views, on a file with every metadata type and several tensor types,
on the synthetic qwen2 GGUF and on the embedded SmolLM2 GGUF (a real 49k-token vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from velox_mlx_lm.embedded import kquant  # noqa: E402


def _agree(path: Path, architecture: str) -> kquant.GgufFile:
    ours = kquant.read_gguf(path, architecture)
    assert kquant.architecture(path) == architecture  # the header walk alone agrees
    theirs = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        got = ours.fields[key]
        assert type(got) is type(value) and got == value, key
        if isinstance(value, list):  # Python values inside too, not NumPy scalars
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == want.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in want.shape), mine.name
        assert mine.data.dtype == want.data.dtype and mine.data.shape == want.data.shape
        assert mine.data.tobytes() == want.data.tobytes(), mine.name
    return ours


def _every_type(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo, ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "日本"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, (3, 288), dtype=np.uint8)  # 2 blocks of 256 per row, 144 B each
    writer.add_tensor("q4k", q4k, raw_shape=q4k.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_metadata_type_and_tensor_layout(tmp_path: Path) -> None:
    ours = _agree(_every_type(tmp_path / "types.gguf"), "qwen2")
    assert ours.fields["t.strs"] == ["a", "", "日本"] and ours.fields["t.u64"] == 2**63 + 5
    q4k = {t.name: t for t in ours.tensors}["q4k"]
    assert q4k.shape == (512, 3) and q4k.data.shape == (3, 288)


def test_the_synthetic_qwen2_gguf(tmp_path: Path) -> None:
    from velox_mlx_lm.embedded.tiny_qwen2 import write_tiny_qwen2_gguf

    path = write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    ours = _agree(path, "qwen2")
    weights = dict((name, v) for name, _, v in kquant.tensors(ours, lambda n: n))
    want = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.0.attn_q.weight"]
    expected = gguf.quants.dequantize(want.data, want.tensor_type)
    assert np.array_equal(weights["blk.0.attn_q.weight"], expected)


@pytest.mark.model
def test_the_embedded_smollm2_gguf(embedded_model_path: Any) -> None:
    ours = _agree(embedded_model_path, "llama")
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49_152


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        kquant.read_gguf(tmp_path / "missing.gguf", "qwen2")
    (tmp_path / "text.gguf").write_bytes(b"not a gguf file at all")
    (tmp_path / "empty.gguf").write_bytes(b"")
    for bad in ("text.gguf", "empty.gguf"):
        with pytest.raises(ValueError, match="not a GGUF file"):
            kquant.read_gguf(tmp_path / bad, "qwen2")
        with pytest.raises(ValueError, match="not a GGUF file"):
            kquant.architecture(tmp_path / bad)
    path = _every_type(tmp_path / "types.gguf")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'qwen2'.*'gemma3'"):
        kquant.read_gguf(path, "gemma3")
