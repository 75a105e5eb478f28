"""velox_bench.probes.decode_trace on a tiny random llama (no weights), and its counting rules on
hand-made sequences."""

from __future__ import annotations

from velox_bench.models import tiny_llama
from velox_bench.probes import decode_trace as tool

CACHE, LAYER, FAST, HOOK, BASE, UNDO = (
    "velox_mlx_lm.cache",
    "velox_cache_core.layer",
    "velox_cache_core.fast_step",
    "velox_mlx_lm.hook",
    "velox_mlx_lm.base",
    "velox_cache_core.undo",
)


def test_returns_to_left_on_hand_made_sequences() -> None:
    assert tool.returns_to_left([]) == 0
    assert tool.returns_to_left([CACHE, LAYER, FAST]) == 0
    assert tool.returns_to_left([CACHE, LAYER, CACHE]) == 1
    assert tool.returns_to_left([CACHE, CACHE]) == 1  # two stays: it was left in between
    assert tool.returns_to_left([CACHE, LAYER, FAST, HOOK, CACHE, BASE, LAYER]) == 2
    # issue 47's baseline: layer 0's share of a TOVA step, 6 modules entered 14 times
    baseline = [BASE, CACHE, LAYER, CACHE, LAYER, CACHE, LAYER, FAST, HOOK, CACHE, BASE, LAYER]
    baseline += [FAST, UNDO]
    assert len(baseline) == 14 and len(set(baseline)) == 6
    assert tool.returns_to_left(baseline) == 8


def _call(module: str, entry: bool, outermost: bool = False, layer: int = -1) -> tool._Call:
    return tool._Call(module, "f", entry, outermost, layer, in_eval=False)


def test_shares_split_at_outermost_calls() -> None:
    record = [
        _call(BASE, True, outermost=True, layer=0),  # make_mask, asked of the first cache
        _call(CACHE, True, outermost=True, layer=1),
        _call(LAYER, True),
        _call(LAYER, False),  # a call inside the module: no entry
        _call(CACHE, True, outermost=True, layer=0),
        _call(LAYER, True),
        _call(CACHE, True),  # back into the cache module from the layer: a return
        _call(HOOK, True, outermost=True),  # no cache among its arguments
    ]
    shares, rest = tool._shares(record, 2)
    assert shares[0] == tool.LayerShare(0, 4, (BASE, CACHE, LAYER, CACHE))
    assert shares[1] == tool.LayerShare(1, 3, (CACHE, LAYER))
    assert (shares[0].returns, shares[1].returns) == (1, 0)
    assert rest == tool.LayerShare(tool.UNATTRIBUTED, 1, (HOOK,))


def test_trace_of_a_tiny_model_step() -> None:
    model = tiny_llama()
    # three warm-up steps: the layer warms, learns that the model hands its rows back, then
    # traces the one-call kernel (a deferred write); the fourth is steady
    trace = tool.trace_method(model, "tova", budget=16, prompt_tokens=40, warmup=3)
    assert trace.settings["layers"] == len(model.layers) == 2
    assert trace.calls > 0 and trace.eval_calls == 0  # the kernels were compiled in the warm-up
    assert sum(trace.functions.values()) == trace.calls
    assert trace.unattributed is None
    assert sum(s.calls for s in trace.shares) == trace.calls
    layer0 = trace.share(0)
    for module in (CACHE, "velox_cache_core.decode.evicting", HOOK):
        assert module in layer0.modules  # a steady step goes through the decode path's store
    assert all(tool.is_project(m) for m in layer0.modules)
    assert layer0.returns == tool.returns_to_left(layer0.modules) > 0
    assert layer0.returns <= 2  # issue 47's bound: at most 2 returns per layer
    assert layer0.entries == len(layer0.modules) >= layer0.distinct
    assert trace.functions["velox_mlx_lm.hook:velox_scaled_dot_product_attention"] == 2
    assert trace.functions["velox_mlx_lm.cache:PolicyKVCache.update_and_fetch"] == 2
    # mlx-lm asks the first layer's cache for the step's mask: layer 0's share holds it
    assert layer0.calls > trace.share(1).calls
    assert trace.as_dict()["layer"]["returns"] == layer0.returns
    assert "tova" in tool.table([trace])
