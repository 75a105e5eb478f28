"""One rank of the distributed tests (``test_distributed.py`` launches it with ``mlx.launch``).

Every rank builds the same model (same seed) and runs each case on its shard; rank 0 also
runs it on the unsharded model (the single-process reference, no communication; once, not on
every rank: the ranks share this host's cores). Each rank writes what it saw to
``<out>/rank<r>.json``: per case, the greedy tokens and, per layer and local KV head, the
sorted kept positions (``reference`` is ``None`` except on rank 0). The test compares every
shard with rank 0's reference.

    python distributed_worker.py OUT tensor|pipeline|embedded [STEPS] [CASE ...]

- ``tensor``: a llama with 8 query / 4 KV heads, ``model.shard(group)``.
- ``pipeline``: a qwen2 with 4 layers, ``model.model.pipeline(group)``.
- ``embedded``: the embedded SmolLM2 (9 query / 3 KV heads), ``model.shard(group)``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# isort: off
import velox_mlx_lm  # noqa: F401  (first: loads OpenBLAS before mlx does, velox_blas)
import mlx.core as mx

# isort: on
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2

from velox_mlx_lm import KVCacheBuilder, KVCacheConfig
from velox_mlx_lm.distributed import shard_model, tensor_group
from velox_mlx_lm.pins import pin_span

PROMPT = 40
STEPS = 64  # greedy decode steps (the first argument after the mode overrides it)
PREFILL_STEP = 16  # several chunks: sequential scans and oneshot cuts at every chunk
BUDGET = 16
PIN = (8, 11)  # a pinned span inside the prompt: 3 tokens, what H2O at budget 16 can pin

# name -> (KVCacheConfig fields, for_model group: "auto" or None = all-reduce disabled;
# PER_LAYER = "auto" with one all_sum per layer and step instead of for_model's StepSums)
PER_LAYER = "per_layer"
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "tova": ({"method": "tova"}, "auto"),
    "tova_adapted": ({"method": "tova_adapted"}, "auto"),
    "tova_oneshot": ({"method": "tova", "tova_prefill": "oneshot"}, "auto"),
    "tova_key_layer": ({"method": "tova", "tova_signal": "key"}, "auto"),
    "tova_per_layer": ({"method": "tova"}, PER_LAYER),
    "h2o_layer": ({"method": "h2o", "h2o_scope": "layer"}, "auto"),
    "h2o_head": ({"method": "h2o", "h2o_scope": "head"}, "auto"),
    "h2o_layer_oneshot": (
        {"method": "h2o", "h2o_scope": "layer", "h2o_prefill": "oneshot"},
        "auto",
    ),
    "morphkv": ({"method": "morphkv", "morphkv_window": 4}, "auto"),
    "morphkv_max": ({"method": "morphkv", "morphkv_window": 4, "morphkv_fusion": "max"}, "auto"),
    "snapkv": ({"method": "snapkv", "snapkv_window": 4}, "auto"),
    "streaming_llm": ({"method": "streaming_llm"}, "auto"),
    # The test of the test: layer scope without the all-reduce must diverge from the reference.
    "tova_no_allreduce": ({"method": "tova"}, None),
    # quantized rows (issue 30): each rank quantizes its own heads' rows
    "tova_q4": ({"method": "tova", "kv_bits": 4, "kv_group_size": 32}, "auto"),
    "tova_q4_channel": (
        {"method": "tova", "kv_bits": 4, "kv_group_size": 32, "kv_key_layout": "channel"},
        "auto",
    ),
    "h2o_head_q8": (
        {"method": "h2o", "h2o_scope": "head", "kv_bits": 8, "kv_group_size": 32},
        "auto",
    ),
    # pinned spans (issue 49): tokens PIN never evicted, on every rank's heads and stage
    "tova_pinned": ({"method": "tova", "pin": PIN}, "auto"),
    "h2o_head_pinned": ({"method": "h2o", "h2o_scope": "head", "pin": PIN}, "auto"),
    "snapkv_pinned": ({"method": "snapkv", "snapkv_window": 4, "pin": PIN}, "auto"),
    # a demoted tier (issue 49): each rank demotes its own heads' rows; the layer-wide
    # decisions summed over the group per layer and call (not through StepSums)
    "tova_tier": (
        {"method": "tova", "demote_bits": 2, "demote_budget": 12, "kv_group_size": 32},
        "auto",
    ),
    "h2o_head_tier": (
        {
            "method": "h2o",
            "h2o_scope": "head",
            "demote_bits": 4,
            "demote_budget": 12,
            "kv_group_size": 32,
        },
        "auto",
    ),
    # adaptive allocation (issue 34): each rank shares the rows among the heads it holds
    "tova_head_alloc": ({"method": "tova_adapted", "tova_allocation": "head"}, "auto"),
    "snapkv_global": (
        {"method": "snapkv", "snapkv_window": 4, "snapkv_allocation": "global"},
        "auto",
    ),
}
PIPELINE_CASES = (
    "tova",
    "h2o_layer",
    "snapkv",
    "streaming_llm",
    "tova_q4",
    "tova_q4_channel",
    "tova_pinned",
    "tova_tier",
)


def _sharpen(model: Any, factor: float) -> None:
    """Scale q/k projections so a random model's attention is peaked (far from ties)."""
    for layer in model.layers:
        attn = layer.self_attn
        attn.q_proj.weight = attn.q_proj.weight * factor
        attn.k_proj.weight = attn.k_proj.weight * factor


def tiny_llama() -> Any:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,  # a group of 32 features divides it (the quantized cases)
        rms_norm_eps=1e-5,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    _sharpen(model, 3.0)
    mx.eval(model.parameters())
    return model


def tiny_qwen2() -> Any:
    mx.random.seed(0)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=128,  # head_dim 32: a group of 32 features divides it (quantized cases)
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    _sharpen(model, 3.0)
    mx.eval(model.parameters())
    return model


def embedded() -> Any:
    from velox_mlx_lm.embedded import load_default

    return load_default()[0]


def run(
    model: Any, prompt: mx.array, fields: dict[str, Any], group: Any, steps: int = STEPS
) -> dict[str, Any]:
    fields = dict(fields)
    pin = fields.pop("pin", None)
    config = KVCacheConfig(**fields, **_budget(fields["method"]))
    caches = KVCacheBuilder.for_model(model, config, group="auto" if group == PER_LAYER else group)
    if pin is not None:
        pin_span(caches, *pin)
    if group == PER_LAYER:
        for cache in caches:
            cache.share_step_sums(None)
    tokens = [
        int(t)
        for t, _ in generate_step(
            prompt, model, max_tokens=steps, prompt_cache=caches, prefill_step_size=PREFILL_STEP
        )
    ]
    kept, demoted = [], []
    for cache in caches:
        positions = cache.positions
        kept.append(None if positions is None else mx.sort(positions[0], axis=-1).tolist())
        tier = getattr(cache, "layer", None) and cache.layer.tier
        demoted.append(None if not tier else mx.sort(tier.positions[0], axis=-1).tolist())
    return {
        "tokens": tokens,
        "kept": kept,
        "demoted": demoted,
        "grouped": [c.group is not None for c in caches],
        "step_sums": [c.step_sums is not None for c in caches],
    }


def _budget(method: str) -> dict[str, int]:
    policy = {"tova_adapted": "tova"}.get(method, method)
    return {f"{policy}_budget": BUDGET}


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else STEPS
    world = mx.distributed.init()
    make = {"tensor": tiny_llama, "pipeline": tiny_qwen2, "embedded": embedded}[mode]
    mx.random.seed(1)
    vocab = 128 if mode != "embedded" else 2000
    prompt = mx.random.randint(0, vocab, (PROMPT,))
    reference_model = make() if world.rank() == 0 else None
    if mode == "pipeline":
        sharded = make()
        sharded.model.pipeline(world)
    else:
        sharded = shard_model(make(), world)
    names = tuple(sys.argv[4:]) or (PIPELINE_CASES if mode == "pipeline" else tuple(CASES))
    result: dict[str, Any] = {
        "rank": world.rank(),
        "size": world.size(),
        "detected_group": tensor_group(sharded) is not None,
        "layers": None,
        "cases": {},
    }
    if mode == "pipeline":
        inner = sharded.model
        result["layers"] = [inner.start_idx, inner.end_idx]
    for name in names:
        fields, group = CASES[name]
        reference = None
        if reference_model is not None:
            reference = run(reference_model, prompt, fields, None, steps)
        result["cases"][name] = {
            "reference": reference,
            "sharded": run(sharded, prompt, fields, group, steps),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{world.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
