"""The architectures table: tiny configs of every transformers decoder the engine is tested on, and the refused.

`PARITY` (model type, or "type/variant" for a second configuration of a type -> config overrides on top of `COMMON`) is what
`test_architectures.py` runs to parity with transformers; `REFUSED` (model type
-> (overrides, the reason `LLMEngine.from_hf` must give)) what it must refuse.
`docs/MODELS.md` is `render_markdown()`, which also lists the architectures the
older parity suites cover (`hf_models.ARCHS`, `test_mla.py`, `test_encoder_decoder.py`);
`test_architectures.py` checks it, PAGEDKV_WRITE_DOCS=1 rewrites it.
"""

from __future__ import annotations

from typing import Any

import torch
from state_models import STATE_MODELS

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=512, initializer_range=0.2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
SLIDING = {"sliding_window": 8}
TWO_TYPES = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# model type -> overrides (GQA 4:2 wherever the config has num_key_value_heads); most common first
PARITY: dict[str, dict[str, Any]] = {
    "phi3": SLIDING,
    "phi": {"partial_rotary_factor": 0.5},
    "olmo2": {},
    "olmo3": TWO_TYPES,
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granite": {"attention_multiplier": 0.3, "residual_multiplier": 0.5, "logits_scaling": 2.0,
                "embedding_multiplier": 3.0},
    "cohere": {"use_qk_norm": True},
    "cohere2": TWO_TYPES,
    "qwen2_moe": {**MOE, "shared_expert_intermediate_size": 32},
    "qwen3_moe": MOE,
    "mixtral": {**SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {"head_dim": 16},
    "starcoder2": SLIDING,
    "exaone4": TWO_TYPES,
    "glm": {"head_dim": 16},
    "glm4": {"head_dim": 16},
    "glm4_moe": {**MOE, "n_routed_experts": 4, "first_k_dense_replace": 1, "head_dim": 16},
    "smollm3": {"no_rope_layers": [1, 0]},
    "ministral": {**ROPE, **TWO_TYPES, "head_dim": 16},
    "apertus": {},
    "seed_oss": {"head_dim": 16},
    "gpt2": {},
    "gpt_neox": {"rotary_pct": 0.5},
    "helium": {"head_dim": 16},
    "ernie4_5": {"head_dim": 16},
    "hunyuan_v1_dense": {**ROPE, "head_dim": 16},
    "arcee": {"head_dim": 16},
    "bitnet": {},
    "persimmon": {},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "minimax_m2": {**MOE, "num_local_experts": 4, "head_dim": 16, "rotary_dim": 8},
    "jetmoe": {"num_experts_per_tok": 2, "kv_channels": 16},
    "bloom": {},
    "mpt": {"attn_config": {"alibi": True}},
    "falcon": {"alibi": True},
    "falcon/rotary": {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 2},
    "stablelm": {},
    "gemma4_text": {**TWO_TYPES, "num_kv_shared_layers": 0, "head_dim": 16, "global_head_dim": 32,
                    "hidden_size_per_layer_input": 16},
}  # fmt: skip

# (model type, overrides, the reason in from_hf's ValueError, a regex)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("gemma4_text", {"head_dim": 16, "global_head_dim": 16, "num_kv_shared_layers": 1, "num_hidden_layers": 3,
                     "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
     "1 layers reuse the K/V of earlier layers"),
]  # fmt: skip


# test_stray_config.py: config attributes set, on every architecture above (and the recurrent-state ones) whose
# config leaves them unset, to values its model does not use ("sliding": every layer a sliding layer)
STRAY: dict[str, Any] = {"num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4, "layer_types": "sliding"}
# (model type, attribute): its model does read it, and transformers itself cannot run with the stray value
STRAY_BREAKS_TRANSFORMERS = {
    ("olmoe", "head_dim"), ("helium", "head_dim"), ("bitnet", "head_dim"), ("persimmon", "head_dim"),
    ("stablelm", "head_dim"),
}  # fmt: skip
# model type -> the reason from_hf refuses it with its stray attributes (a regex)
STRAY_REFUSED = {
    "olmoe": "passes sliding_window=4 to its attention function but its layer's attention mask keeps every earlier key",
}


def config_for(model_type: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config `build` uses: `COMMON` and `overrides` (default: the type's `PARITY` row), GQA 4:2 where the
    config has ``num_key_value_heads`` and `overrides` do not set it."""
    import transformers as tf

    kwargs = {**COMMON, **(PARITY.get(model_type, {}) if overrides is None else overrides)}
    model_type = model_type.partition("/")[0]  # "falcon/rotary": a second configuration of one model type
    config = tf.AutoConfig.for_model(model_type, **kwargs)
    if getattr(config, "num_key_value_heads", None) is not None and "num_key_value_heads" not in kwargs:
        config = tf.AutoConfig.for_model(model_type, **kwargs, num_key_value_heads=2)
    return config


def build(model_type: str, overrides: dict[str, Any] | None = None, seed: int = 0) -> Any:
    """A tiny fp32 model of `model_type` (eager attention, seeded random weights, eos disabled)."""
    import transformers as tf

    config = config_for(model_type, overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def _older_suites() -> dict[str, str]:
    """Model type -> the parity suite that covers it, for the architectures outside `PARITY`."""
    import transformers as tf

    from hf_models import ARCHS
    from hf_models import COMMON as HF_COMMON

    covered = {}
    for spec in ARCHS.values():
        config_cls, _, extra = spec(tf)
        model_type = config_cls(**{**HF_COMMON, **extra}).model_type
        hybrid = any(k in extra for k in ("sliding_window", "attention_chunk_size", "layer_types"))
        covered[model_type] = "test_hybrid_parity.py" if hybrid else "test_parity.py"
    covered.update({"deepseek_v2": "test_mla.py", "deepseek_v3": "test_mla.py", "bart": "test_encoder_decoder.py"})
    return covered


STATE_KINDS = {
    "qwen3_next": "gated delta net", "qwen3_5_text": "gated delta net", "qwen3_5_moe_text": "gated delta net (MoE)",
    "olmo_hybrid": "gated delta net", "lfm2_moe": "short convolution (MoE)",
    "bamba": "Mamba2", "granitemoehybrid": "Mamba2", "falcon_h1": "Mamba2 beside attention in every layer",
    "nemotron_h": "Mamba2 (and MLP-only layers)", "jamba": "Mamba1", "lfm2": "short convolution",
    "mamba2": "Mamba2 (no attention)", "mamba": "Mamba1 (no attention)",
}  # fmt: skip
STATE_SHOWN = ("layer_types", "layers_block_type", "attn_layer_indices", "attn_layer_period", "attn_layer_offset",
               "mamba_chunk_size", "chunk_size", "linear_conv_kernel_dim", "conv_kernel", "conv_L_cache")  # fmt: skip


def render_markdown() -> str:
    """docs/MODELS.md: the architectures the tests run to parity with transformers, and the refused ones."""
    lines = [
        "# Model architectures",
        "",
        "Generated from `tests/engine/architectures.py` (`PAGEDKV_WRITE_DOCS=1` rewrites it; "
        "`tests/engine/test_architectures.py` checks it). Every row below is a transformers model type whose tiny "
        "random-weight model generates on `LLMEngine.from_hf` the same greedy tokens as transformers' own "
        "`generate()`, with fp32 logits within 1e-4, with prefix caching (a second wave reuses a prefix that is not "
        "page-aligned), in the smallest pool any one request fits, so that the first wave preempts. Any other "
        "decoder whose "
        "attention goes through transformers' `AttentionInterface` is accepted too (`pagedkv.hf.support`), "
        "without a code change; what cannot run is refused with a `ValueError` before the model is touched.",
        "",
        "| model type | tested in | config of the test |",
        "|---|---|---|",
    ]
    for model_type, overrides in PARITY.items():
        shown = ", ".join(f"`{k}={v!r}`" for k, v in overrides.items()) or "defaults"
        lines.append(f"| `{model_type.partition('/')[0]}` | test_architectures.py | {shown} |")
    for model_type, suite in _older_suites().items():
        lines.append(f"| `{model_type}` | {suite} | |")
    lines += [
        "",
        "## Recurrent-state models",
        "",
        "Every row below has layers that keep a recurrent state (gated delta net, Mamba2, Mamba1, short "
        "convolution) in pagedkv's state rows, a pool beside its attention pages "
        "(`tests/engine/test_state_models.py`): prompts of 1 to 60 tokens cut at odd places by a 13-token "
        "budget, steps mixing prefill chunks and decodes, fp32 logits within 1e-3 of one full forward of "
        "transformers over prompt + output at every generated position, greedy tokens equal to its argmax, "
        "and again in a pool that forces preemption. Prefix caching hits on them through state checkpoints "
        "(docs/STATE.md): requests resuming from one give the same tokens and logits "
        "(`tests/engine/test_state_model_prefix_hits.py`: gated delta net, Mamba2 and short-convolution hybrids).",
        "",
        "| model type | state layers | config of the test |",
        "|---|---|---|",
    ]
    for model_type, overrides in STATE_MODELS.items():
        shown = ", ".join(f"`{k}={v!r}`" for k, v in overrides.items() if k in STATE_SHOWN) or "defaults"
        lines.append(f"| `{model_type}` | {STATE_KINDS[model_type]} | {shown} |")
    strays = ", ".join(f"`{k}={v!r}`" for k, v in STRAY.items())
    lines += [
        "",
        "## Config attributes the model does not use",
        "",
        "`LLMEngine.from_hf` takes the page layout from what the attention modules compute (their K/V heads and "
        "head size, the window or chunk their masks and attention calls carry, observed in one 2-token forward "
        "that leaves the model as it was: `pagedkv.hf.probe`), never from config attributes the model does not "
        "read, and cross-checks the config against it. `tests/engine/test_stray_config.py` builds every "
        f'architecture above with each of {strays} (`"sliding"`: every layer a sliding layer) that its config '
        "does not set itself. A stray `num_key_value_heads` or `head_dim` changes nothing: the engine equals "
        "transformers' own `generate()` (fp32 logits within 1e-4; the recurrent-state models their full forward, "
        "within 1e-3). A stray `sliding_window` or `layer_types` is different: transformers' own cache (and so "
        "its `generate()`) keeps the window the config names whatever the model's attention does, so the model "
        "has two answers; where the config's window differs from the one a layer's attention keeps, `from_hf` "
        "refuses with a `ValueError` naming the layer, both windows and the attribute to change (for example "
        "`config.sliding_window = None` on GPT-2), the model untouched. Where they agree (Mistral, Phi-3, "
        "Mixtral, Starcoder2: their layers do slide by that window), the engine equals `generate()`. Where the "
        "model's own parts disagree (a module passes a `sliding_window` its mask does not keep, keys and values "
        "of different shapes, ALiBi slopes for another head count), `from_hf` refuses too.",
        "",
        "| model type | stray attribute | outcome |",
        "|---|---|---|",
    ]
    for model_type, attr in sorted(STRAY_BREAKS_TRANSFORMERS):
        lines.append(f"| `{model_type}` | `{attr}` | not set: the model reads it and transformers cannot run it |")
    for model_type, reason in STRAY_REFUSED.items():
        lines.append(f"| `{model_type}` | `sliding_window`, `layer_types` | refused: {reason} |")
    lines += ["", "## Refused (for now)", "", "| model type | config | reason |", "|---|---|---|"]
    for model_type, overrides, reason in REFUSED:
        shown = ", ".join(f"`{k}={v!r}`" for k, v in overrides.items()) or "defaults"
        lines.append(f"| `{model_type}` | {shown} | {reason.replace(chr(92), '')} |")
    return "\n".join(lines) + "\n"
