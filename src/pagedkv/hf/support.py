"""Which transformers decoders pagedkv can serve, decided from the model itself (no list of model types).

A decoder runs on pagedkv when every one of its layers is self-attention over
its own K/V through transformers' `AttentionInterface` (the attention module's
``forward`` looks its function up in ``ALL_ATTENTION_FUNCTIONS``), with no
argument to that function that pagedkv would drop. What the model computes
around attention (partial rotary, QK-norm, NoPE layers, multipliers, parallel
residuals, MoE routers, learned absolute positions) needs nothing more than the
``position_ids`` the engine passes. Scaling, softcap, sliding windows and
learned sinks (``s_aux``) arrive as keywords that `pagedkv.hf.attention`
applies; Bloom, MPT and Falcon (ALiBi or rotary) compute attention
themselves and are served by wrapping their attention modules
(`pagedkv.hf.alibi`); windows and chunks come from the config's layer types
(`pagedkv.hf.config`), and so do per-layer K/V shapes of heterogeneous configs
(Gemma 4: `kv_shapes`, one page-table group per attention type and shape).

Recurrent layers (Mamba, Mamba2, gated delta net, short convolutions) run when
`pagedkv.hf.mixers` has an adapter for their mixer class (`state_modules`):
their state lives in pagedkv's state slots.

`check_config` refuses, from the config alone, what no decoder layout can hold:
layer types that are neither attention nor a served state, vision or audio
towers, K/V shared across layers, ALiBi other than `pagedkv.hf.alibi`'s. `check_model` adds the checks on the
modules; both raise ValueError naming the model type and the reason, before
anything in the model is changed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import torch

from pagedkv.hf.alibi import kv_shape as alibi_kv_shape
from pagedkv.hf.alibi import wrapped_type

__all__ = [
    "ATTENTION_KINDS",
    "ATTENTION_KEYWORDS",
    "STATE_KINDS",
    "state_modules",
    "attention_modules",
    "check_config",
    "check_model",
    "kv_shape",
    "kv_shapes",
]

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# layer types whose mixer keeps a recurrent state (served by `pagedkv.hf.mixers`), "hybrid" has attention and a
# state mixer side by side (Falcon-H1); "mlp" / "moe" layers (Nemotron-H) keep nothing
STATE_KINDS = ("linear_attention", "conv", "mamba", "hybrid")
CACHELESS_KINDS = ("mlp", "moe")
# keywords of the attention-function call that pagedkv applies (or that change nothing at inference)
ATTENTION_KEYWORDS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", "position_ids"})
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_MULTIMODAL = ("vision_config", "audio_config", "vision_tower", "mm_tokens_per_image")


def _refuse(config: Any, reason: str) -> ValueError:
    return ValueError(f"model_type={getattr(config, 'model_type', None)!r} cannot run on pagedkv: {reason}")


def _alibi(config: Any) -> bool:
    attn_config = getattr(config, "attn_config", None)
    nested = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    return bool(getattr(config, "alibi", False) or nested)


def check_config(config: Any) -> None:
    """Raise ValueError when no pagedkv decoder layout can hold this config's model."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(config, "encoder-decoder models run on pagedkv.engine.EncoderDecoderEngine")
    if any(getattr(config, name, None) is not None for name in _MULTIMODAL):
        raise _refuse(config, "it takes vision or audio inputs; only text decoders are served")
    if getattr(config, "num_kv_shared_layers", 0):
        raise _refuse(config, f"{config.num_kv_shared_layers} layers reuse the K/V of earlier layers (KV sharing)")
    if _alibi(config) and wrapped_type(config) is None:
        raise _refuse(config, "it adds ALiBi position biases, which pagedkv's attention does not apply yet")
    kinds = getattr(config, "layer_types", None) or []
    other = sorted({k for k in kinds if k not in ATTENTION_KINDS + STATE_KINDS + CACHELESS_KINDS})
    if other:
        raise _refuse(config, f"layer types {other} are neither attention nor a recurrent state pagedkv serves")


def _per_layer_shapes(config: Any) -> list[tuple[int, int]] | None:
    """(K/V heads, head size) of each layer of a heterogeneous config (transformers' ``per_layer_config``,
    e.g. Gemma 4), or None for a homogeneous one. Reads only the per-layer views."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    shapes = []
    for layer in config.per_layer_config:
        heads = layer.num_attention_heads
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        shapes.append((kv_heads, getattr(layer, "head_dim", None) or layer.hidden_size // heads))
    return shapes


def kv_shape(config: Any) -> tuple[int, int]:
    """(K/V heads, head size) of a config: ``num_key_value_heads`` (else every query head) and ``head_dim``
    (else hidden size / heads); a heterogeneous config's from its first layer (`kv_shapes` has every layer's)."""
    shapes = _per_layer_shapes(config)
    if shapes:
        return shapes[0]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def kv_shapes(config: Any) -> list[tuple[int, int]]:
    """(K/V heads, head size) of every layer: per layer for a heterogeneous config (Gemma 4's sliding and
    full layers differ), else `kv_shape` for all."""
    shapes = _per_layer_shapes(config)
    return shapes if shapes else [kv_shape(config)] * config.num_hidden_layers


def _forward_code(module: torch.nn.Module) -> Any:
    forward = inspect.unwrap(type(module).forward)
    return getattr(forward, "__code__", None)


def _routes_through_interface(module: torch.nn.Module) -> bool:
    code = _forward_code(module)
    return code is not None and _INTERFACE in code.co_names


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose ``forward`` calls an attention function of transformers' `AttentionInterface`."""
    return [(name, m) for name, m in model.named_modules() if _routes_through_interface(m)]


def _attention_keywords(module: torch.nn.Module) -> set[str] | None:
    """Keywords the module's forward passes to the interface's function, or None if the source is unreadable."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
            names.update(k.arg for k in node.keywords if k.arg is not None)
    return names


def _uses_alibi(model: torch.nn.Module) -> bool:
    for m in model.modules():
        code = _forward_code(m)
        if code is not None and any("alibi" in name.lower() for name in code.co_names + code.co_varnames):
            return True
    return False


def state_modules(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
    """Layer index -> (name, module) of every mixer that keeps a recurrent state (`pagedkv.hf.mixers` has an
    adapter for its class). ValueError when such a module has no integer ``layer_idx`` or two share one."""
    from pagedkv.hf.mixers import adapter_for

    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        if adapter_for(module) is None:
            continue
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or isinstance(idx, bool):
            raise _refuse(model.config, f"state mixer {name} has no integer layer_idx")
        if idx in found:
            raise _refuse(model.config, f"state mixers {found[idx][0]} and {name} share layer_idx {idx}")
        found[idx] = (name, module)
    return found


def check_model(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Layer index -> (K/V heads, head size) of each of `model`'s attention layers, or ValueError naming the
    model type and the reason when it cannot run on pagedkv pages.

    Every layer must have attention through the `AttentionInterface`, a state mixer `pagedkv.hf.mixers`
    serves (`state_modules`), both (Falcon-H1), or be a layer the config types "mlp" / "moe" (no cache).

    Reads the config (`check_config`) and the modules; changes nothing. The shape is what the
    attention modules pass to the attention function: ``head_dim`` and ``num_key_value_groups`` of the
    modules where they have them (JetMoE repeats its K/V heads before the call), else the config's
    (per layer where the config is heterogeneous: Gemma 4's full layers have their own head size).
    """
    config: Any = model.config
    check_config(config)
    if wrapped_type(config) is not None:  # attention modules wrapped by `pagedkv.hf.alibi`
        return dict.fromkeys(range(config.num_hidden_layers), alibi_kv_shape(config))
    attention = attention_modules(model)
    states = state_modules(model)
    if not attention and states:  # a pure state model (Mamba, Mamba2)
        _check_covered(config, set(), states)
        return {}
    if not attention:
        if _uses_alibi(model) and getattr(config, "alibi", True):
            raise _refuse(config, "it adds ALiBi position biases, which pagedkv's attention does not apply yet")
        raise _refuse(config, "it has neither attention through transformers' AttentionInterface nor a "
                              "recurrent-state mixer pagedkv serves (pagedkv.hf.mixers)")  # fmt: skip
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise _refuse(config, "transformers cannot switch its attention implementation")
    mla = getattr(config, "model_type", None) in ("deepseek_v2", "deepseek_v3")
    seen: dict[int, str] = {}
    shapes: dict[int, tuple[int, int]] = {}
    config_shapes = _per_layer_shapes(config)
    for name, module in attention:
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise _refuse(config, f"attention module {name} has no integer layer_idx")
        if idx in seen:
            raise _refuse(config, f"attention modules {seen[idx]} and {name} share layer_idx {idx}")
        seen[idx] = name
        if hasattr(module, "kv_b_proj") and not mla:
            raise _refuse(config, f"{name} is latent attention (MLA); only DeepSeek V2/V3's MLA is wired")
        if getattr(module, "is_causal", True) is False:
            raise _refuse(config, f"{name} attends bidirectionally (is_causal=False)")
        extra = sorted((_attention_keywords(module) or set()) - ATTENTION_KEYWORDS)
        if extra:
            raise _refuse(config, f"{name} passes {extra} to its attention function, which pagedkv does not apply")
        if config_shapes is not None and idx < len(config_shapes):
            layer_config = config.per_layer_config[idx]
            (kv_heads, head), q_heads = config_shapes[idx], layer_config.num_attention_heads
        else:
            (kv_heads, head), q_heads = kv_shape(config), config.num_attention_heads
        groups = getattr(module, "num_key_value_groups", None)
        if isinstance(groups, int) and groups > 0:
            kv_heads = q_heads // groups
        own_head = getattr(module, "head_dim", None)
        shapes[idx] = (kv_heads, own_head if isinstance(own_head, int) else head)
    _check_covered(config, set(seen), states)
    if mla:
        return dict.fromkeys(sorted(seen), kv_shape(config))
    return {i: shapes[i] for i in sorted(shapes)}


def _check_covered(config: Any, attention: set[int], states: dict[int, Any]) -> None:
    """ValueError unless every layer index has attention or a state mixer (or is an "mlp" / "moe" layer),
    and no module's index lies outside the layers."""
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None:
        return
    kinds = list(getattr(config, "layer_types", None) or [])
    cacheless = {i for i, k in enumerate(kinds) if k in CACHELESS_KINDS}
    covered = attention | set(states) | cacheless
    missing = sorted(set(range(layers)) - covered)
    if missing:
        raise _refuse(
            config,
            f"layers {missing} have neither attention through AttentionInterface nor a recurrent-state mixer "
            "pagedkv serves (pagedkv.hf.mixers)",
        )
    if not covered <= set(range(layers)):
        raise _refuse(config, f"layer indices {sorted(covered)} do not match {layers} layers")
