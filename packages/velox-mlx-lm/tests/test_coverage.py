"""The coverage matrix: every text architecture of the installed mlx-lm, built tiny and random
(``model_zoo``), generated with Velox caches against the model's own.

Per architecture:

- without eviction (budget above the length), the logits of every call equal the model's own
  caches' within 1e-5, and so do the greedy tokens;
- with eviction (each policy at a budget under the prompt's length), every Velox cache holds
  at most what its policy promises after every call (its budget; plus the tokens after the
  prompt for a policy that grows after the prompt's end), and every other cache stops growing
  once the prompt is in (sliding windows, recurrent state);
- where Velox cannot serve the model exactly, the outcome is documented: the key-signal
  fallback with its warning, or an error naming the model type and the reason.

The outcome table is written as JSON to ``$VELOX_COVERAGE_JSON`` when set
(``tools/models_table.py`` turns it into ``docs/models.md``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import model_zoo
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.cache import PolicyKVCache

PROMPT = 20  # prompt tokens, fed as chunks of CHUNKS then the last token alone (as mlx-lm does)
CHUNKS = (12, 7)
STEPS = 5  # greedy decode steps after the prompt
LONG_BUDGET = 64  # above PROMPT + STEPS: nothing is evicted
SHORT_BUDGET = 8  # under PROMPT: every layer evicts
EVICTING = ("tova", "h2o", "streaming_llm", "snapkv", "morphkv", "expected_attention")
EXTRA = {"morphkv": {"morphkv_window": 2}}  # its default window (8) leaves nothing to evict at 8
TOLERANCE = 1e-5

# What a run ends as; the first three count as working.
EXACT = "exact within budget"
FALLBACK = "key-signal fallback (warned)"
NOTHING = "nothing to evict"
REFUSED = "refused (clear error)"
NO_CPU = "does not run on CPU"
FAILED = "FAILED"

RESULTS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_table() -> Iterator[None]:
    yield
    path = os.environ.get("VELOX_COVERAGE_JSON")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(RESULTS.items())), f, indent=1)
            f.write("\n")


def _leaves(caches: Any) -> Iterator[Any]:
    """Every layer cache, those nested in mlx-lm's ``CacheList`` included."""
    for cache in caches:
        nested = getattr(cache, "caches", None)
        if nested is not None:
            yield from _leaves(nested)
        else:
            yield cache


def _tokens() -> mx.array:
    return mx.array(np.random.default_rng(0).integers(0, model_zoo.VOCAB, size=(1, PROMPT)))


class Bounds:
    """After every call: each Velox cache within its policy's promise, every other cache not
    growing once the prompt is in."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches
        self.sizes: dict[int, int] = {}
        self.after_prompt = 0

    def check(self, arch: str, decoding: bool) -> None:
        for i, cache in enumerate(_leaves(self.caches)):
            if isinstance(cache, PolicyKVCache):
                if not decoding:  # SnapKV keeps its prompt whole until the prompt's end
                    continue
                layer = cache.layer
                budget = layer.policy.traits.budget(layer.state)
                promise = budget + (self.after_prompt if layer.policy.grows_after_prompt_end else 0)
                assert cache.size() <= promise, (
                    f"{arch}: {type(cache).__name__} holds {cache.size()} rows, promised "
                    f"{promise} (silently unbounded)"
                )
                continue
            size = int(cache.size()) if hasattr(cache, "size") else 0
            bound = getattr(cache, "max_size", None)  # a sliding window still filling up
            within = isinstance(bound, int) and size <= bound
            if decoding and size > self.sizes.get(i, size) and not within:
                raise AssertionError(
                    f"{arch}: layer cache {i} ({type(cache).__name__}) grows while decoding: "
                    f"{self.sizes[i]} -> {size} rows (silently unbounded)"
                )
            self.sizes[i] = size
        if decoding:
            self.after_prompt += 1


def _generate(model: Any, caches: list[Any], bounds: Bounds | None = None) -> list[np.ndarray]:
    """The logits of the last position of every call: prompt chunks, the prompt's last token,
    then greedy steps."""
    arch = getattr(model, "model_type", "?")
    tokens = _tokens()
    calls = []
    start = 0
    for n in CHUNKS:
        calls.append(tokens[:, start : start + n])
        start += n
    calls.append(tokens[:, start:])
    out = []
    for i in range(len(calls) + STEPS):
        x = calls[i] if i < len(calls) else mx.array([[int(np.argmax(out[-1]))]])
        logits = model(x, cache=caches)[:, -1].astype(mx.float32)
        mx.eval(logits, [c.state for c in caches])
        out.append(np.array(logits[0]))
        if bounds is not None:
            bounds.check(arch, decoding=i >= len(calls) - 1)
    return out


def _names_model(error: BaseException, arch: str, model_type: str) -> bool:
    text = str(error)
    return model_type in text or arch in text


def _warned(caught: list[warnings.WarningMessage]) -> bool:
    return any("signal" in str(w.message) and "key" in str(w.message) for w in caught)


def _exactness(arch: str, model: Any, reference: list[np.ndarray]) -> dict[str, Any]:
    """The run without eviction (budget above the length) against the model's own caches."""
    model_type = str(getattr(model, "model_type", arch))
    config = KVCacheConfig(method="tova", tova_budget=LONG_BUDGET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            caches = KVCacheBuilder.for_model(model, config)
            if not any(isinstance(c, PolicyKVCache) for c in _leaves(caches)):
                assert not caught, f"{arch}: warned with no Velox cache: {caught[0].message}"
                return {"outcome": NOTHING}
            logits = _generate(model, caches)
        except (ValueError, TypeError, RuntimeError) as e:
            assert _names_model(e, arch, model_type), f"{arch}: error without the model type: {e}"
            return {"outcome": REFUSED, "reason": str(e)}
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, reference, strict=True))
    same = [int(np.argmax(a)) for a in logits] == [int(np.argmax(b)) for b in reference]
    assert diff <= TOLERANCE and same, (
        f"{arch}: without eviction the logits differ by {diff:.3g} (tokens equal: {same}): "
        "silently wrong"
    )
    return {"outcome": FALLBACK if _warned(caught) else EXACT, "max_diff": diff}


def _bounded(arch: str, model: Any, method: str) -> str | None:
    """A run with eviction: within budget after every call, finite logits; or a clear refusal
    (returned)."""
    fields = {f"{method}_budget": SHORT_BUDGET, **EXTRA.get(method, {})}
    model_type = str(getattr(model, "model_type", arch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **fields))
            logits = _generate(model, caches, Bounds(caches))
        except (ValueError, TypeError, RuntimeError) as e:
            assert _names_model(e, arch, model_type), f"{arch}: error without the model type: {e}"
            return f"{method}: {e}"
    assert all(np.isfinite(x).all() for x in logits), f"{arch} with {method}: non-finite logits"
    return None


@pytest.mark.parametrize("arch", model_zoo.architectures())
def test_architecture(arch: str) -> None:
    if arch in model_zoo.CRASHES:
        RESULTS[arch] = {"outcome": NO_CPU, "reason": model_zoo.CRASHES[arch]}
        pytest.skip(f"{arch}: {model_zoo.CRASHES[arch]}")
    try:
        model = model_zoo.build(arch)
        reference = _generate(model, make_prompt_cache(model))
    except (Exception, SystemExit) as e:  # record why the model cannot run here
        RESULTS[arch] = {"outcome": NO_CPU, "reason": f"{type(e).__name__}: {e}"[:200]}
        pytest.skip(f"{arch} does not run on this machine: {RESULTS[arch]['reason']}")
    try:
        result = _exactness(arch, model, reference)
        if result["outcome"] in (EXACT, FALLBACK):
            refusals = [r for r in (_bounded(arch, model, m) for m in EVICTING) if r]
            if refusals:
                result["refused"] = refusals
    except BaseException as e:
        RESULTS[arch] = {"outcome": FAILED, "reason": f"{type(e).__name__}: {e}"[:300]}
        raise
    RESULTS[arch] = result


def test_windowed_full_cache_is_refused() -> None:
    # mistral3 with a sliding window asks its full-attention KVCache for a windowed mask: a
    # Velox cache cannot serve that exactly and says so, naming the model.
    model = model_zoo.build("mistral3", overrides={"sliding_window": model_zoo.WINDOW})
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", tova_budget=8))
    with pytest.raises(ValueError, match=r"mistral3.*sliding-window"):
        model(_tokens(), cache=caches)
