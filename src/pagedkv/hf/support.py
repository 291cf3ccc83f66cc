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
(`pagedkv.hf.alibi`). Each attention layer's page layout (K/V heads, head
size, window or chunk: `AttentionLayer`) is what its module computes, observed
in one tiny forward (`check_model`, `pagedkv.hf.probe`), never read from config
attributes the model may not use; layers of different kinds or shapes (Gemma 4's
full layers have a larger head) get page-table groups of their own
(`pagedkv.hf.config`). Without a model, `kv_shapes` reads the same from the config.

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
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.hf.alibi import observe as alibi_observe
from pagedkv.hf.alibi import wrapped_type
from pagedkv.hf.probe import Observed, observe

__all__ = [
    "ATTENTION_KINDS",
    "ATTENTION_KEYWORDS",
    "AttentionLayer",
    "STATE_KINDS",
    "state_modules",
    "attention_modules",
    "cache_windows",
    "check_cache_windows",
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


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer's cache, as its module computes it (`check_model`).

    Attributes:
        kv_heads, head_size: each K and V row it stores is [kv_heads, head_size] (MLA: one latent of
            ``kv_lora_rank + qk_rope_head_dim``).
        q_heads: the query heads it attends with.
        kind: "full_attention", "sliding_attention" (keys ``q - window < k <= q``) or "chunked_attention"
            (keys of the query's own chunk of ``window``).
        window: the sliding window or the chunk size; None for full attention.
    """

    kv_heads: int
    head_size: int
    q_heads: int
    kind: str = "full_attention"
    window: int | None = None


def check_model(model: torch.nn.Module) -> dict[int, AttentionLayer]:
    """Layer index -> the `AttentionLayer` of each of `model`'s attention layers, or ValueError naming the
    model type and the reason when it cannot run on pagedkv pages.

    Every layer must have attention through the `AttentionInterface`, a state mixer `pagedkv.hf.mixers`
    serves (`state_modules`), both (Falcon-H1), or be a layer the config types "mlp" / "moe" (no cache).

    The layout is what the modules compute, never what the config says: the K/V heads and head size, the
    query heads and the window or chunk of each layer are observed in one 2-token forward
    (`pagedkv.hf.probe.observe`; ALiBi models: each module's own projection, `pagedkv.hf.alibi.observe`),
    so config attributes the model does not use (a ``num_key_value_heads`` on GPT-2) change nothing. A config
    ``sliding_window`` / ``layer_types`` / ``attention_chunk_size`` that gives a layer another window than its
    attention keeps is refused (`cache_windows`: transformers' own cache keeps the config's window, so the
    model would have two answers). Where the modules contradict each other (a layer whose mask keeps every key but
    whose attention call passes a ``sliding_window``, keys and values of different shapes) or the config
    value the model's own code uses elsewhere (an ALiBi model's head count), ValueError names both values.
    Reads the config (`check_config`) and the modules; the model is left as it was.
    """
    config: Any = model.config
    check_config(config)
    if wrapped_type(config) is not None:  # attention modules wrapped by `pagedkv.hf.alibi`
        layers = _alibi_layers(model)
        check_cache_windows(config, layers)
        return layers
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
    _check_covered(config, set(seen), states)
    observed = observe(model, mla=mla)
    layers = {idx: _layer(config, seen[idx], observed.get(idx), mla) for idx in sorted(seen)}
    check_cache_windows(config, layers)
    return layers


def cache_windows(config: Any) -> list[tuple[str, int | None]]:
    """Per layer, the kind and window transformers' own cache gives it (``DynamicCache(config=...)``, which
    `generate()` uses): ("sliding_attention", W) keeps the last W keys, ("chunked_attention", C) the query's
    chunk, ("full_attention", None) every key; other layer types (state mixers, "mlp") are ("other", None).
    The rule of transformers' ``get_layer_types_and_kwargs``: the config's ``layer_types``, else a layer is
    sliding when its ``sliding_window`` is set, chunked when its ``attention_chunk_size`` is."""
    try:
        per_layer = list(config.per_layer_config)
    except (AttributeError, TypeError):  # (transformers before heterogeneous configs: one config for every layer)
        per_layer = [config] * config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        kinds = [
            "sliding_attention" if getattr(c, "sliding_window", None) is not None
            else "chunked_attention" if getattr(c, "attention_chunk_size", None) is not None
            else "full_attention"
            for c in per_layer
        ]  # fmt: skip
    out: list[tuple[str, int | None]] = []
    for kind, layer_config in zip(kinds, per_layer, strict=False):
        if kind == "sliding_attention":
            out.append((kind, getattr(layer_config, "sliding_window", None)))
        elif kind == "chunked_attention":
            out.append((kind, getattr(layer_config, "attention_chunk_size", None)))
        elif kind in STATE_KINDS[:-1] + CACHELESS_KINDS:
            out.append(("other", None))
        else:  # "full_attention", "attention", "hybrid" (Falcon-H1's attention beside a mixer)
            out.append(("full_attention", None))
    return out


def _describe(kind: str, window: int | None) -> str:
    if kind == "sliding_attention":
        return f"a sliding window of {window} keys"
    if kind == "chunked_attention":
        return f"chunks of {window} tokens"
    return "every earlier key"


def check_cache_windows(config: Any, layers: dict[int, AttentionLayer]) -> None:
    """ValueError when the config gives an attention layer another window than its module applies.

    transformers' own cache (and so its `generate()`) keeps the keys the config's ``layer_types`` /
    ``sliding_window`` / ``attention_chunk_size`` say, while the model's attention sees what its module's mask
    keeps: where the two differ (a stray ``sliding_window`` on a model whose attention never reads it) the
    model has two answers, and pagedkv serves neither silently. The error names the layer, both windows and
    the attribute to change."""
    windows = cache_windows(config)
    for idx, layer in layers.items():
        if idx >= len(windows) or windows[idx][0] == "other":
            continue
        kind, window = windows[idx]
        if (kind, window) != (layer.kind, layer.window):
            attribute = "layer_types" if getattr(config, "layer_types", None) is not None else (
                "sliding_window" if kind == "sliding_attention" else "attention_chunk_size")  # fmt: skip
            raise _refuse(
                config,
                f"layer {idx}'s attention keeps {_describe(layer.kind, layer.window)}, but the config "
                f"(layer_types={getattr(config, 'layer_types', None)!r}, sliding_window="
                f"{getattr(config, 'sliding_window', None)!r}) gives it {_describe(kind, window)}, which "
                f"transformers' own cache and generate() keep: the model and its config disagree; set "
                f"config.{attribute} to what the model computes (e.g. config.{attribute} = None) and call from_hf "
                "again",
            )


def _layer(config: Any, name: str, seen: Observed | None, mla: bool) -> AttentionLayer:
    """The `AttentionLayer` of module `name` from what it passed in the probe forward (`seen`)."""
    if seen is None:
        raise _refuse(config, f"attention module {name} was not called in a forward pass of the model")
    (q_heads, q_size), (kv_heads, head), value = seen.query, seen.key, seen.value
    if mla and (kv_heads != 1 or value != seen.key):
        raise _refuse(config, f"MLA layer {name} cached no latent in a forward pass (its attention got K/V of "
                              f"(heads, size)={seen.key})")  # fmt: skip
    if not mla:
        if value != seen.key:
            raise _refuse(config, f"{name} passes keys of (heads, size)={seen.key} but values of {value}; a "
                                  "page holds one [H_kv, D] for both")  # fmt: skip
        if q_size != head:
            raise _refuse(config, f"{name} passes queries of head size {q_size} but keys of {head}")
        if q_heads % kv_heads:
            raise _refuse(config, f"{name} passes {q_heads} query heads, not a multiple of its {kv_heads} K/V heads")
    kind, window = _window(config, name, seen)
    return AttentionLayer(kv_heads, head, q_heads, kind, window)


def _window(config: Any, name: str, seen: Observed) -> tuple[str, int | None]:
    """The attention kind and window of a layer: what its mask keeps, which its ``sliding_window`` keyword must
    agree with (transformers' eager and SDPA paths apply the mask, its flash kernels the keyword)."""
    keyword = seen.window_keyword
    if seen.window is None:  # no mask of transformers' mask functions, or one that is not causal attention
        raise _refuse(config, f"the attention mask {name} gets is not a causal, sliding-window or chunked mask of "
                              "transformers' masking functions, so pagedkv cannot tell which keys it sees")  # fmt: skip
    kind, window = seen.window
    if kind == "full_attention" and keyword is not None:
        raise _refuse(config, f"{name} passes sliding_window={keyword} to its attention function but its layer's "
                              "attention mask keeps every earlier key (the model's attention implementations "
                              "disagree on its window)")  # fmt: skip
    if kind == "sliding_attention" and keyword is not None and keyword != window:
        raise _refuse(config, f"{name} passes sliding_window={keyword} to its attention function but its layer's "
                              f"attention mask keeps a window of {window}")  # fmt: skip
    if kind == "chunked_attention" and keyword is not None:
        raise _refuse(config, f"{name} passes sliding_window={keyword} to its attention function but its layer's "
                              f"attention mask keeps chunks of {window}")  # fmt: skip
    return kind, window


def _alibi_layers(model: torch.nn.Module) -> dict[int, AttentionLayer]:
    """The layers of a model whose attention `pagedkv.hf.alibi` wraps: full attention, the shapes its modules'
    projections give; its ALiBi slopes come from the config's head count, which must be the modules'."""
    config: Any = model.config
    layers = {}
    for idx, (query, key, value) in sorted(alibi_observe(model).items()):
        if key != value:
            raise _refuse(config, f"layer {idx} computes keys of (heads, size)={key} but values of {value}")
        heads = getattr(config, "num_attention_heads", None)
        if query[0] != heads:
            raise _refuse(config, f"layer {idx} computes {query[0]} query heads but num_attention_heads={heads}, "
                                  "which its ALiBi slopes are built for")  # fmt: skip
        layers[idx] = AttentionLayer(key[0], key[1], query[0])
    _check_covered(config, set(layers), {})
    return layers


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
