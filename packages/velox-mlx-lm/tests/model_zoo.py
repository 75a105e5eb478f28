"""Every text architecture of the installed mlx-lm as a tiny random model (for ``test_coverage``).

Each module of ``mlx_lm/models`` that defines ``Model`` and ``ModelArgs`` is one architecture.
Its config comes from the module's ``ModelArgs`` dataclass: every field in :data:`TINY` (two
layers, small dimensions, a few experts, sliding windows of 8 tokens) takes the tiny value,
every other field keeps its default, and :data:`OVERRIDES` adds what one architecture needs
beyond that (per-layer lists, nested configs). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models

VOCAB = 128
LAYERS = 2
WINDOW = 8  # sliding windows: shorter than the test's prompt, so rotating caches are full

# Field name -> tiny value, for every architecture whose ModelArgs has the field.
TINY: dict[str, Any] = {
    # sizes
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "hidden_dim": 64,
    "d_model": 64,
    "dim": 64,
    "model_dim": 64,
    "n_embd": 64,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "n_inner": 64,
    "ff_intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "shared_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    # layers
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_transformer_layers": LAYERS,
    # heads
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_query_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "n_kv_heads": 2,
    "head_dim": 16,
    # MLA: keys (nope + rope = 16 wide) and values of a different width
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 12,
    # experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
    # positions, norms, windows
    "max_position_embeddings": 4096,
    "n_positions": 4096,
    "n_ctx": 4096,
    "model_max_length": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "layer_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "norm_eps": 1e-5,
    "partial_rotary_factor": 0.5,
    "sliding_window": WINDOW,
    "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    # recurrent layers
    "conv_kernel": 4,
    "conv_L_cache": 3,
    "state_size": 8,
    "ssm_state_size": 8,
    "time_step_rank": 4,
    "n_groups": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    # switches and scalars some architectures require
    "rope_scaling": None,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rotary_emb_base": 10000.0,
    "rotary_pct": 0.5,
    "rotary_dim": 8,
    "post_norm": False,
    "qk_norm": True,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "conv_bias": False,
    "use_conv_bias": True,
    "conv_window": 2,
    "conv1d_width": 4,
    "logits_soft_cap": 30.0,
    "layer_group_size": 2,
    "group_norm_size": 1,
    "sliding_window_pattern": 2,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "logits_scaling": 1.0,
    "attention_multiplier": 0.25,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "use_mixed_mlp_moe": False,
    "use_cla": False,
    "cla_share_factor": 1,
    "attn_layer_offset": 1,
    "attn_layer_period": 2,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "mamba_d_conv": 4,
    "mamba_d_state": 8,
    "mamba_expand": 2,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "use_expert_bias": False,
    "num_dense_layers": 1,
    "block_size": 4096,
    "attention_chunk_size": 8,
    "interleave_moe_layer_step": 1,
    "zero_expert_type": "identity",
    "zero_expert_num": 1,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "time_step_limit": (0.0, float("inf")),
    "dim_model_base": 64,
    "scale_depth": 1.0,
    "scale_emb": 1.0,
    "linear_allow_neg_eigval": False,
    "ffn_dim_divisor": 16,
    "dense_attention_every_n_layers": 2,
    "gegelu_limit": 16.0,
    "a_low_rank_dim": 8,
    "v_low_rank_dim": 8,
    "gate_low_rank_dim": 8,
    "decay_low_rank_dim": 8,
    "num_attention_groups": 2,
    "num_kv_reuse_layers": 1,
    "layer_types": ["sliding_attention", "full_attention"],
    "full_attention_interval": 2,
}

# Architecture -> fields beyond TINY (None: the architecture is not a text model we build).
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
OVERRIDES: dict[str, dict[str, Any]] = {
    "baichuan_m1": {"sliding_window_layers": [0]},
    "dbrx": {
        "d_model": 64,
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "type": "yarn"}},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096}},
    "exaone4": {"sliding_window_pattern": "LG"},
    "exaone_moe": {"is_moe_layer": [False, True]},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
    },
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "kimi_k3": {
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 8,
            "kda_layers": [1],
            "full_attn_layers": [2],
            "short_conv_kernel_size": 4,
        }
    },
    "mellum": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    "kimi_linear": {
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 8,
            "kda_layers": [1],
            "full_attn_layers": [2],
            "short_conv_kernel_size": 4,
        }
    },
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2-vl": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "llama4": {  # every 4th layer is global
        "num_hidden_layers": 4,
        "num_experts_per_tok": 1,
        "no_rope_layers": [1, 1, 1, 0],
        "intermediate_size_mlp": 64,
    },
    "gemma3n": {  # layers 2, 3 share the KV of layers 0, 1
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "vocab_size_per_layer_input": VOCAB,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": 30.0,
        "activation_sparsity_pattern": [0.0] * 4,
        "hidden_size_per_layer_input": 8,
        "altup_num_inputs": 2,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_active_idx": 0,
        "laurel_rank": 8,
    },
    "gemma4": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma4_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "llama4_text": {"no_rope_layers": [1, 0], "num_experts_per_tok": 1},
    "longcat_flash": {"attention_method": "MLA"},
    "minimax_m3_vl": {"moe_layer_freq": [0, 1]},
    "muse_spark": {
        "post_norm_eps": 1e-5,
        "layer_rope_theta": [10000.0, 10000.0],
        "final_logit_softcapping": 30.0,
        "output_multiplier": 1.0,
        "moe_hidden_size": 32,
        "num_shared_experts": 0,
    },
    "mimo_v2_flash": {
        "moe_layer_freq": [0, 1],
        "hybrid_layer_pattern": [1, 0],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 12,
    },
    # released configs without a sliding window (with one, mlx-lm windows a full KVCache's
    # mask and Velox refuses: test_coverage.test_windowed_full_cache_is_refused)
    "mistral3": {"sliding_window": None},
    "pixtral": {"sliding_window": None},
    "smollm3": {"sliding_window": None},
    "ministral3": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        }
    },
    "mistral4": {
        "rope_parameters": {
            **_ROPE,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 4096,
        }
    },
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        ]
    },
    "nemotron_h": {"hybrid_override_pattern": ["M", "*"]},
    "openelm": {"num_query_heads": [4, 4], "num_kv_heads": [2, 2], "ffn_multipliers": [1.0, 1.0]},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "spark2_5": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    "step3p5": {"moe_top_k": 2},
}


# Architectures that crash the process on the CPU with their own mlx-lm caches (nothing of
# Velox involved), with why: recorded, never run.
CRASHES = {
    "phi3small": "its block-sparse attention aborts the process on a second prompt chunk "
    "(mlx CPU), with mlx-lm's own caches",
}


def architectures() -> list[str]:
    """Every module of ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs`` (by source,
    without importing: some import optional packages)."""
    names = []
    path = mlx_lm.models.__path__
    for info in pkgutil.iter_modules(path):
        source = Path(path[0], f"{info.name}.py").read_text(encoding="utf-8")
        if "class Model(" in source and "class ModelArgs" in source:
            names.append(info.name)
    return sorted(names)


def _fill(cls: Any, arch: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Values for ``cls``'s dataclass fields: TINY where named, then ``extra``."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "text_config":
            values[f.name] = {**TINY, "model_type": arch, **extra}
        elif f.name in extra:
            values[f.name] = extra[f.name]
        elif f.name in TINY:
            values[f.name] = TINY[f.name]
        elif f.name == "model_type":
            values[f.name] = arch
    return values


def tiny_args(arch: str, overrides: dict[str, Any] | None = None) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    extra = {**OVERRIDES.get(arch, {}), **(overrides or {})}
    return module.ModelArgs(**_fill(module.ModelArgs, arch, extra))


def build(arch: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> nn.Module:
    """A tiny random float32 model of ``arch`` (``overrides``: config fields beyond the table)."""
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(tiny_args(arch, overrides))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
