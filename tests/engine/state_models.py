"""Tiny random transformers models with recurrent-state layers, built from their own config classes.

One entry per model type: the config keywords of a model small enough for CPU tests (hidden 64, 4 layers,
at least one attention layer where the architecture has attention, chunk sizes small enough that
prefills cross chunk boundaries).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
ATTENTION: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)
GDN: dict[str, Any] = dict(linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4)  # fmt: skip
MAMBA2: dict[str, Any] = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                              mamba_expand=2, mamba_chunk_size=8)  # fmt: skip
HYBRID_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

STATE_MODELS: dict[str, dict[str, Any]] = {
    "qwen3_next": {**ATTENTION, **GDN, "layer_types": HYBRID_TYPES, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1},
    "qwen3_5_text": {**ATTENTION, **GDN, "layer_types": HYBRID_TYPES},
    "qwen3_5_moe_text": {**ATTENTION, **GDN, "layer_types": HYBRID_TYPES, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "olmo_hybrid": {**ATTENTION, **GDN, "layer_types": HYBRID_TYPES},
    "bamba": {**ATTENTION, **MAMBA2, "attn_layer_indices": [2]},
    "granitemoehybrid": {**ATTENTION, **MAMBA2, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                         "num_local_experts": 4, "num_experts_per_tok": 2},
    "falcon_h1": {**ATTENTION, **MAMBA2, "mamba_d_ssm": 128},
    "nemotron_h": {**ATTENTION, "layers_block_type": ["mamba", "mlp", "attention", "mamba"], "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,
                   "expand": 1},
    "jamba": {**ATTENTION, "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
              "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8, "use_mamba_kernels": False},
    "lfm2": {**ATTENTION, "layer_types": ["conv", "full_attention", "conv", "full_attention"], "conv_L_cache": 3},
    "lfm2_moe": {**ATTENTION, "layer_types": ["conv", "full_attention", "conv", "full_attention"], "conv_L_cache": 3,
                 "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "conv_kernel": 4, "chunk_size": 8,
               "expand": 2},
    "mamba": {"state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 8, "use_mambapy": False},
}  # fmt: skip


def config_for(model_type: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config of `model_type` `build_state_model` uses (`overrides`: more keywords)."""
    return CONFIG_MAPPING[model_type](**{**COMMON, **STATE_MODELS[model_type], **(overrides or {})})


def build_state_model(
    model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None
) -> Any:
    """A random model of `model_type` (eager attention, eval mode) from `STATE_MODELS`; `overrides`: more config
    keywords."""
    config = config_for(model_type, overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()
