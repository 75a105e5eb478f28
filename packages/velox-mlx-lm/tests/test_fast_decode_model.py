"""The decode fast path inside a model: greedy decoding with it on and off gives the same logits
bit for bit, the same cache states and the same trims (speculative decoding's), for every
method that opts in, on tiny llama and qwen3 models through the attention hook."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from velox_cache_core import fast_step
from velox_cache_core.decode.evicting import Evicting
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

METHODS = {
    "tova": {"tova_budget": 10, "tova_n_sink": 2},
    "tova_adapted": {"tova_budget": 10, "tova_n_sink": 2},
    "h2o": {"h2o_budget": 10, "h2o_n_sink": 2, "h2o_recent": 3},
    "morphkv": {"morphkv_budget": 10, "morphkv_n_sink": 2, "morphkv_window": 3},
    "streaming_llm": {"streaming_llm_budget": 10, "streaming_llm_n_sink": 2},
    "snapkv": {"snapkv_budget": 10, "snapkv_window": 4},
}


def _decode(
    model, method: str, on: bool, prompt: mx.array, steps: int, defer: bool = True
) -> tuple[list, list]:
    fast_step.ENABLED = on
    try:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, **METHODS[method]))
        if not defer:  # rows another layer may read: every step writes before it attends
            for c in caches:
                c.shared_rows = True
        logits = model(prompt, cache=caches)[:, -1:]
        outs = []
        y = mx.argmax(logits, axis=-1)
        for i in range(steps):
            logits = model(y, cache=caches)[:, -1:]
            outs.append(np.array(logits))
            y = mx.argmax(logits, axis=-1)
            if i == steps // 2:  # a verify round's rejection: take back 2 tokens, feed 1 again
                for c in caches:
                    c.trim(2)
                logits = model(y, cache=caches)[:, -1:]
                outs.append(np.array(logits))
        fast = [c.layer.fast_path for c in caches]
        return outs, [c.state for c in caches] + [fast]
    finally:
        fast_step.ENABLED = True


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_fast_decode_is_the_general_path(tiny_model, h, arch: str, method: str) -> None:
    model = tiny_model(arch)
    prompt = h.random_tokens(17, seed=5)
    fast_out, fast_states = _decode(model, method, True, prompt, 12)
    slow_out, slow_states = _decode(model, method, False, prompt, 12)
    assert all(fast_states[-1]), "every layer's next step takes the fast path"
    assert not any(slow_states[-1])
    for a, b in zip(fast_out, slow_out, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(fast_states[:-1], slow_states[:-1], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], mx.array):
                assert np.array_equal(np.array(a[name]), np.array(b[name])), name
            else:
                assert a[name] == b[name], name


@pytest.mark.parametrize("method", ["tova", "h2o", "streaming_llm", "morphkv"])
def test_deferred_writes_equal_written_ones(tiny_model, h, monkeypatch, method: str) -> None:
    """A model that hands update_and_fetch's arrays back to the hook untouched gets decode steps
    that write their token in attend, with the decision, in one compiled call: the same logits,
    states and trims as steps that write first (both on the decode path)."""
    deferred: list[bool] = []
    write = Evicting.write

    def spy(self, *args, **kwargs):
        out = write(self, *args, **kwargs)
        deferred.append(self.deferred is not None)
        return out

    monkeypatch.setattr(Evicting, "write", spy)
    model = tiny_model("llama")
    prompt = h.random_tokens(17, seed=6)
    one_out, one_states = _decode(model, method, True, prompt, 12)
    n_deferred = sum(deferred)
    deferred.clear()
    two_out, two_states = _decode(model, method, True, prompt, 12, defer=False)
    assert not any(deferred)
    layers = len(one_states) - 1
    # every layer's steps but its first on the decode path (it learns how the model attends)
    # and the one after the trim (the layer left the path) write in attend
    assert n_deferred >= layers * (12 - 4)
    assert all(one_states[-1]) and all(two_states[-1])
    for a, b in zip(one_out, two_out, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(one_states[:-1], two_states[:-1], strict=True):
        for name in a:
            if isinstance(a[name], mx.array):
                assert np.array_equal(np.array(a[name]), np.array(b[name])), name
            else:
                assert a[name] == b[name], name


def test_a_model_attending_otherwise_after_deferred_writes_is_an_error(tiny_model, h) -> None:
    """After decode steps that handed the rows back untouched, a step whose attention brings
    keys of its own cannot be served (its token is not written yet): a RuntimeError saying so."""
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="tova", tova_budget=10))
    y = mx.argmax(model(h.random_tokens(17, seed=7), cache=caches)[:, -1:], axis=-1)
    for _ in range(3):
        y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
    cache = caches[0]
    hot = cache.layer.hot
    assert hot is not None
    keys = mx.zeros(hot.token[0])
    k, v = cache.update_and_fetch(keys, keys)
    assert hot.deferred is not None
    with pytest.raises(RuntimeError, match="update_and_fetch"):
        cache.attend(keys, 0.25, None, None, keys=k + 0, values=v)
