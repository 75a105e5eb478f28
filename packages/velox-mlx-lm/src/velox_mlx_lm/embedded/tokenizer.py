"""Byte-level BPE tokenizer rebuilt from GGUF metadata, usable by ``mlx_lm.generate``."""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .gguf import metadata_scalar

__all__ = ["load_gguf_tokenizer"]

_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, <|endoftext|>, ...)
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact")  # pre-tokenizers that split 1 digit a token


def load_gguf_tokenizer(metadata: dict[str, Any]) -> TokenizerWrapper:
    """Build the tokenizer stored in GGUF ``metadata`` (``tokenizer.ggml.*`` keys).

    Only the ``gpt2`` (byte-level BPE) model is supported. Control tokens are special (never
    split, skipped by ``decode(..., skip_special_tokens=True)``); BOS/EOS/UNK/PAD and the chat
    template come from the metadata.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only 'gpt2' (byte-level BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, byte_fallback=False
    )
    tok = Tokenizer(bpe)
    pre: list[pre_tokenizers.PreTokenizer] = []
    if metadata.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING:
        pre.append(pre_tokenizers.Digits(individual_digits=True))
    pre.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"].tolist()
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
    return TokenizerWrapper(hf, BPEStreamingDetokenizer)
