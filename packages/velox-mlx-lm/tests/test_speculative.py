"""Speculative decoding (mlx-lm's ``speculative_generate_step``) on the embedded model with Velox
caches: the verification pass is a chunk that evicts, rejected drafts are trimmed exactly, so
greedy output equals plain decoding with the same cache, token for token.

The draft is the embedded model's first 4 layers (``velox_mlx_lm.embedded.draft_of``): same
vocabulary, often wrong, so trims happen most rounds. This CI-sized run decodes 24 tokens; the
speculative benchmark (``nox -s bench -- speculative``) checks the same over 300.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.embedded import draft_of, load_default

METHODS = ["tova", "tova_adapted", "h2o", "streaming_llm", "morphkv"]
BUDGET = 32
TOKENS = 24
TEXT = (
    "The Roman Empire grew out of the Roman Republic. Its emperors ruled lands around the "
    "Mediterranean Sea for centuries, and its roads, laws and language shaped Europe. "
) * 3


@pytest.fixture(scope="module")
def models(embedded_model_path: Any) -> tuple[Any, Any, Any]:
    model, tokenizer = load_default()
    return model, draft_of(model, 4), tokenizer


def config(method: str) -> KVCacheConfig:
    policy = "tova" if method.startswith("tova") else method
    return KVCacheConfig(method=method, **{f"{policy}_budget": BUDGET})


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_speculative_equals_plain_decoding(models: tuple[Any, Any, Any], method: str) -> None:
    model, draft, tokenizer = models
    prompt = mx.array(tokenizer.encode(TEXT))
    assert prompt.size > 2 * BUDGET
    plain_caches = KVCacheBuilder.for_model(model, config(method))
    plain = [
        int(t)
        for t, _ in generate_step(prompt, model, prompt_cache=plain_caches, max_tokens=TOKENS)
    ]
    caches = KVCacheBuilder.for_model(model, config(method))
    drafted = KVCacheBuilder.for_model(draft, config(method))
    rounds = speculative_generate_step(
        prompt, model, draft, prompt_cache=caches + drafted, max_tokens=TOKENS, num_draft_tokens=3
    )
    spec, accepted = [], 0
    for token, _, from_draft in rounds:
        spec.append(int(token))
        accepted += from_draft
        assert all(c.size() <= BUDGET for c in caches)
    assert spec == plain
    assert 0 <= accepted < TOKENS
