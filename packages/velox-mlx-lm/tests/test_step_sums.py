"""One ``all_sum`` per forward pass for every layer's decode-step decision (``StepSums``).

In one process there is no second rank, so ``mx.distributed.all_sum`` is replaced by a stand-in
that counts its calls and returns ``2 * x``: what two ranks holding the same heads would sum.
Under it a layer-scope run decides on the head mean of the local heads, whichever way the sums
travel, so the deferred path (``for_model``'s default: one ``all_sum`` per pass) must keep
exactly what the per-layer path (one ``all_sum`` per layer and step) keeps, token for token,
with the same undo log (trims) and the same offsets. Real ranks: ``test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from velox_cache_core.distributed import (
    Recorder,
    Replay,
    StepSums,
    all_sum_together,
    head_mean,
)
from velox_mlx_lm import KVCacheBuilder, KVCacheConfig

PROMPT, STEPS, BUDGET, LAYERS = 40, 20, 16, 3


class _TwoRanks:
    """A group of two ranks in name: the stand-in ``all_sum`` does the communicating."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.fixture
def sums_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Replace ``mx.distributed.all_sum`` by ``2 * x``; the list collects each call's size."""
    calls: list[int] = []

    def all_sum(x: mx.array, *, group: Any = None, stream: Any = None) -> mx.array:
        calls.append(int(x.size))
        return x * 2

    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    return calls


def _model() -> Any:
    """The tiny llama of the real distributed runs (8 query / 4 KV heads, 3 layers)."""
    from distributed_worker import tiny_llama  # this folder's rank program

    model = tiny_llama()
    assert len(model.layers) == LAYERS
    return model


def _run(model: Any, fields: dict[str, Any], per_layer: bool) -> tuple[list[int], list[Any]]:
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**fields), group=_TwoRanks())
    assert all(c.step_sums is caches[0].step_sums is not None for c in caches)
    if per_layer:
        for cache in caches:
            cache.share_step_sums(None)
    prompt = mx.random.randint(0, 128, (PROMPT,), key=mx.random.key(1))
    tokens = [
        int(t)
        for t, _ in generate_step(
            prompt, model, max_tokens=STEPS, prompt_cache=caches, prefill_step_size=16
        )
    ]
    return tokens, caches


def _kept(caches: list[Any]) -> list[Any]:
    return [mx.sort(c.positions, axis=-1).tolist() for c in caches]


CASES = {
    "tova": {"method": "tova", "tova_budget": BUDGET},
    "h2o_layer": {"method": "h2o", "h2o_budget": BUDGET, "h2o_scope": "layer"},
    "morphkv": {"method": "morphkv", "morphkv_budget": BUDGET, "morphkv_window": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_sum_per_pass_decides_like_one_per_layer(sums_counted: list[int], case: str) -> None:
    model = _model()
    fields = CASES[case]
    tokens_layer, per_layer = _run(model, fields, per_layer=True)
    calls_per_layer = len(sums_counted)
    sums_counted.clear()
    tokens_pass, per_pass = _run(model, fields, per_layer=False)
    assert tokens_pass == tokens_layer
    assert _kept(per_pass) == _kept(per_layer)
    for a, b in zip(per_pass, per_layer, strict=True):
        assert a.offset == b.offset == PROMPT + STEPS  # mlx-lm computes one step ahead
        sa, sb = a.policy_state.slots, b.policy_state.slots
        assert all(mx.array_equal(x, y) for x, y in zip(sa.arrays(), sb.arrays(), strict=True))
        assert a.trimmable_tokens == b.trimmable_tokens > 0
    # mlx-lm feeds the prompt but its last token in chunks, then one token per call: each of
    # those calls (all past the budget) sends one all_sum for all layers instead of one per layer.
    singles = PROMPT + STEPS - (PROMPT - 1)
    assert calls_per_layer - len(sums_counted) == singles * (LAYERS - 1)
    # Exact trims still work after deferred steps, and agree.
    for a, b in zip(per_pass, per_layer, strict=True):
        a.trim(3)
        b.trim(3)
        assert mx.array_equal(a.positions, b.positions) and mx.array_equal(a.keys, b.keys)


def test_head_scope_sends_nothing(sums_counted: list[int]) -> None:
    """``tova_adapted`` decides per KV head: nothing is deferred or summed while decoding."""
    model = _model()
    fields = {"method": "tova_adapted", "tova_budget": BUDGET}
    tokens, caches = _run(model, fields, per_layer=False)
    assert len(tokens) == STEPS and not sums_counted
    assert caches[0].step_sums is not None and caches[0].step_sums.pending == 0


def test_a_read_before_the_last_layer_sends_the_sums(sums_counted: list[int]) -> None:
    """A stats read between layers (not what a model does) enters no collective: it reads the
    state before the deferred step. Reading the policy state settles it: one all_sum, then
    the state is whole."""
    model = _model()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CASES["tova"]), group=_TwoRanks())
    prompt = mx.random.randint(0, 128, (1, PROMPT), key=mx.random.key(1))
    model(prompt, cache=caches)
    mx.eval([c.state for c in caches])
    sums = caches[0].step_sums
    assert sums is not None
    y = mx.array([[3]])
    layer0 = model.model.layers[0]
    h = model.model.embed_tokens(y)
    offset = caches[0].offset
    layer0(h, mask=None, cache=caches[0])  # layer 0 alone: its decision waits
    assert sums.pending == 1 and caches[0].offset == offset + 1
    sums_counted.clear()
    kept = caches[0].size()  # a stats read: no collective
    assert sums.pending == 1 and len(sums_counted) == 0 and kept == BUDGET
    kept = caches[0].policy_state.n_kept  # settles it: one all_sum, then the state is whole
    assert sums.pending == 0 and len(sums_counted) == 1 and kept == BUDGET


def test_recorder_replay_and_joined_sum(sums_counted: list[int]) -> None:
    group = _TwoRanks()
    x = mx.random.uniform(shape=(1, 1, 4, 1, 9))
    rec = Recorder(group)
    placeholder = head_mean(x, 2, rec)
    assert len(rec.sums) == 1 and mx.array_equal(placeholder, x.sum(axis=2) / 8)
    summed = all_sum_together([rec.sums[0], mx.ones((2, 3))], group)
    assert len(sums_counted) == 1 and sums_counted[0] == 9 + 6  # one collective for both
    assert mx.array_equal(summed[1], 2 * mx.ones((2, 3)))
    replay = Replay(group, [summed[0]])
    assert mx.array_equal(head_mean(x, 2, replay), summed[0] / 8)
    with pytest.raises(RuntimeError, match="more head sums"):
        head_mean(x, 2, replay)
    assert all_sum_together([], group) == []


def test_step_sums_arguments() -> None:
    with pytest.raises(TypeError, match="group"):
        StepSums(None, 2)
    with pytest.raises(ValueError, match="layers"):
        StepSums(_TwoRanks(), 0)
    sums = StepSums(_TwoRanks(), 2)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\)"):
        sums.arrive(2)
    assert sums.arrive(1) == [] and sums.pending == 0
    from velox_mlx_lm import TOVAKVCache

    cache = TOVAKVCache(budget=8, group=_TwoRanks())
    with pytest.raises(ValueError, match="group"):
        cache.share_step_sums(StepSums(_TwoRanks(), 2), 0)  # another group object
    with pytest.raises(TypeError, match="StepSums"):
        cache.share_step_sums("sums", 0)  # type: ignore[arg-type]
    mine = StepSums(cache.group, 2)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.share_step_sums(mine, 5)
    cache.share_step_sums(mine, 1)
    assert cache.step_sums is mine
    cache.group = None  # a new group drops the shared sums
    assert cache.step_sums is None
