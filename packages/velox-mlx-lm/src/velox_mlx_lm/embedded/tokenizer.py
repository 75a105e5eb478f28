"""Byte-level BPE tokenizer rebuilt from GGUF metadata, usable by ``mlx_lm.generate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .gguf import metadata_scalar

__all__ = ["QWEN2_SPLIT", "ToolCalls", "load_gguf_tokenizer"]

_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, <|endoftext|>, ...)
_USER_DEFINED = 4  # added tokens that are not control tokens (Qwen2.5's <tool_call>, ...)
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact")  # pre-tokenizers that split 1 digit a token
# Qwen2's pre-tokenizer split (its tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): one
# digit a piece, letters with at most one leading non-letter, punctuation runs with the line
# breaks after them. GPT-2's regex (the fallback) splits code and numbers differently.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


ToolCalls = tuple[str, str, Callable[..., Any]]  # (start marker, end marker, mlx-lm tool parser)


def _pre_tokenizer(pre: str | None) -> tuple[Any, Any]:
    """The normalizer (or ``None``) and pre-tokenizer llama.cpp's ``tokenizer.ggml.pre`` names."""
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre in _DIGIT_SPLITTING:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    return None, pre_tokenizers.Sequence(steps)


def load_gguf_tokenizer(
    metadata: dict[str, Any], tool_calls: ToolCalls | None = None
) -> TokenizerWrapper:
    """Build the tokenizer stored in GGUF ``metadata`` (``tokenizer.ggml.*`` keys).

    Only the ``gpt2`` (byte-level BPE) model is supported; the pre-tokenizer split is the one
    ``tokenizer.ggml.pre`` names (``qwen2``; one digit a token for ``smollm``; else GPT-2's).
    Control tokens are special (never split, skipped by ``decode(..., skip_special_tokens=True)``);
    user-defined tokens (Qwen2.5's ``<tool_call>``) are never split but decode as text.
    BOS/EOS/UNK/PAD and the chat template come from the metadata. ``tool_calls`` gives mlx-lm's
    ``TokenizerWrapper`` the markers and parser its server turns into OpenAI ``tool_calls``.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only 'gpt2' (byte-level BPE)")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False
    )
    tok = Tokenizer(bpe)
    normalizer, tok.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"]
    types = types.tolist() if hasattr(types, "tolist") else list(types)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )

    def token(key: str) -> str | None:
        index = metadata_scalar(metadata, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    if tool_calls is None:
        return TokenizerWrapper(hf, BPEStreamingDetokenizer)
    start, end, parser = tool_calls
    return TokenizerWrapper(
        hf, BPEStreamingDetokenizer, tool_call_start=start, tool_call_end=end, tool_parser=parser
    )
