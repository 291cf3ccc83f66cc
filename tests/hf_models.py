"""Tiny transformers models built from configs with seeded random weights (no hub access)."""

from __future__ import annotations

import copy
from typing import Any

import torch

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip


HYBRID = dict(num_hidden_layers=4, head_dim=16, sliding_window=8)
ARCHS: dict[str, Any] = {
    "llama": lambda tf: (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "qwen2": lambda tf: (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
    "qwen3": lambda tf: (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": lambda tf: (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 8}),
    # softcap 0.5 so that it bites (at the default 50 it changes nothing measurable)
    "gemma2": lambda tf: (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                          {**HYBRID, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.5}),
    "gemma3": lambda tf: (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                          {**HYBRID, "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gpt_oss": lambda tf: (tf.GptOssConfig, tf.GptOssForCausalLM,
                           {**HYBRID, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "llama4": lambda tf: (tf.Llama4TextConfig, tf.Llama4ForCausalLM,
                          {"head_dim": 16, "attention_chunk_size": 8, "no_rope_layer_interval": 2, "num_local_experts": 2,
                           "intermediate_size_mlp": 128, "attn_temperature_tuning": False}),
}  # fmt: skip


def config_for(arch: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config of `arch` `build` uses (`overrides`: more keywords)."""
    import transformers as tf

    config_cls, _, extra = ARCHS[arch](tf)
    return config_cls(**{**COMMON, **extra, **(overrides or {})})


def build(
    arch: str, seed: int = 0, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
    """A tiny fp32 model of `arch` (see ARCHS) with seeded random weights; GQA 4:2; eos disabled. `overrides`:
    more config keywords."""
    import transformers as tf

    _, model_cls, _ = ARCHS[arch](tf)
    config = config_for(arch, overrides)
    torch.manual_seed(seed)
    model = model_cls._from_config(copy.deepcopy(config), attn_implementation=attn_implementation, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' own greedy generate(): (tokens, per-step logits [V])."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]
