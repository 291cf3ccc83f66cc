"""KV cache layout of a transformers model: params (one cache, or one group per attention type) and a layer map.

With the model (`LLMEngine.from_hf`), each attention layer's type
("full_attention", "sliding_attention", "chunked_attention"), window and K/V
shape are what its module computes (`pagedkv.hf.support.check_model`, observed
in one tiny forward: `pagedkv.hf.probe`), never read from config attributes
the model may not use; DeepSeek V2/V3 cache one MLA latent (``kv_lora_rank +
qk_rope_head_dim``) per token. From a config alone they come from
``layer_types`` where the config has them, else every layer is sliding when
``sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2) and full
otherwise, and ``num_key_value_heads`` / ``head_dim``. Mixed types are grouped as vLLM's hybrid
allocator groups them (`pagedkv.interface.group_layer_specs`): each group is
a child ``group{i}`` of a `MultiKVCacheParams`, and `layer_map[i]` says which
group and which layer slot of it layer i uses. Layers of one type whose K/V
shapes differ (Gemma 4's full layers have a larger head) are separate groups,
each with its own page shape over the one pool (`pagedkv.runtime.arena`).
Recurrent mixers (`pagedkv.hf.mixers`) give state layers: each gets a `MambaSpec`
from its mixer, the state groups (`StateCacheParams`) come after the attention
groups, and `state_map[i]` says which state group and slot layer i uses. The
attention page keeps `page_size`: state lives in rows of its own
(`pagedkv.core.state.checkpoints`), so, unlike vLLM's hybrid allocator
(`pagedkv.interface.unify_state_block_size`), no page grows to a state's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.dtype import DeviceRef, DType
from pagedkv.hf import alibi
from pagedkv.hf.support import ATTENTION_KINDS, AttentionLayer, check_config, check_model, kv_shapes, state_modules
from pagedkv.interface.config import KVCacheConfig, KVCacheGroupSpec, group_layer_specs
from pagedkv.params.bridge import params_from_kv_cache_config
from pagedkv.params.kv import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["KVLayout", "kv_layout", "kv_params_from_config", "device_ref"]

_MLA = ("deepseek_v2", "deepseek_v3")


def device_ref(device: torch.device) -> DeviceRef:
    """The `DeviceRef` of a torch device."""
    if device.type == "cuda":
        return DeviceRef.GPU(device.index or 0)
    return DeviceRef("meta", 0) if device.type == "meta" else DeviceRef.CPU()


@dataclass(frozen=True)
class KVLayout:
    """The cache of a model: `params`, model layer index -> (group, slot within the group) of its attention
    (`layer_map`) and of its recurrent state (`state_map`; groups index ``params.leaves()``). Attention groups
    come first, state groups (`StateCacheParams`) after them."""

    params: KVCacheParams | MultiKVCacheParams
    layer_map: dict[int, tuple[int, int]]
    state_map: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def num_attention_groups(self) -> int:
        """Groups holding attention pages (the first ones)."""
        return sum(not isinstance(leaf, StateCacheParams) for leaf in self.params.leaves())

    @property
    def num_groups(self) -> int:
        """Page-table groups (1 unless the model mixes attention types)."""
        return len(self.params.leaves())


def _layer_spec(layer: AttentionLayer, page_size: int, dtype: DType, mla: bool) -> AttentionSpec:
    if mla:
        return MLAAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=layer.head_size, dtype=dtype)
    common: dict[str, Any] = dict(block_size=page_size, num_kv_heads=layer.kv_heads, head_size=layer.head_size,
                                  dtype=dtype)  # fmt: skip
    if layer.kind == "full_attention":
        return FullAttentionSpec(**common)
    if layer.kind not in ("sliding_attention", "chunked_attention"):
        raise ValueError(f"layer type {layer.kind!r} is not supported")
    if layer.window is None:
        what = "sliding_window" if layer.kind == "sliding_attention" else "attention_chunk_size"
        raise ValueError(f"a {layer.kind!r} layer needs {what} (the config sets none)")
    if layer.kind == "sliding_attention":
        return SlidingWindowSpec(**common, sliding_window=layer.window)
    return ChunkedLocalAttentionSpec(**common, attention_chunk_size=layer.window)


def _layer_kinds(config: Any) -> list[str]:
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def _config_layers(config: Any) -> dict[int, AttentionLayer]:
    """The attention layers as the config alone describes them (`kv_layout` without a model)."""
    kinds = _layer_kinds(config)
    if any(k not in ATTENTION_KINDS for k in kinds):
        raise ValueError(f"model_type={config.model_type!r} has recurrent-state layers: pass model= to "
                         "kv_layout so their state shapes come from the modules")  # fmt: skip
    heads = getattr(config, "num_attention_heads", 1)
    if config.model_type in _MLA:
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        return {i: AttentionLayer(1, latent, heads) for i in range(len(kinds))}
    windows = {"sliding_attention": getattr(config, "sliding_window", None),
               "chunked_attention": getattr(config, "attention_chunk_size", None)}  # fmt: skip
    shapes = kv_shapes(config) if alibi.wrapped_type(config) is None else [alibi.kv_shape(config)] * len(kinds)
    if len(kinds) != len(shapes):
        raise ValueError(f"model_type={config.model_type!r}: layer_types has {len(kinds)} entries for "
                         f"{len(shapes)} layers")  # fmt: skip
    return {i: AttentionLayer(kv, head, heads, kind, windows.get(kind)) for i, (kind, (kv, head)) in
            enumerate(zip(kinds, shapes, strict=True))}  # fmt: skip


def kv_layout(
    config: Any,
    *,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    kv_dtype: DType | None = None,
    quantization: KVCacheQuantizationConfig | None = None,
    model: torch.nn.Module | None = None,
    **params_kwargs: Any,
) -> KVLayout:
    """The `KVLayout` of a decoder-only model config.

    ValueError (`pagedkv.hf.support.check_config`) for a config no paged decoder layout holds. With
    `model` (as `LLMEngine.from_hf` passes it), the layout is what its modules compute
    (`pagedkv.hf.support.check_model`: the K/V heads and head size each attention layer stores, its window or
    chunk, observed in one 2-token forward that leaves the model as it was), so config attributes the model
    does not use change nothing; without, everything comes from the config (``layer_types``, else
    ``sliding_window`` on every layer; ``num_key_value_heads``, ``head_dim``). Layers are grouped by attention
    type and K/V shape, so a group's params carry its own ``n_kv_heads`` and ``head_dim`` (Gemma 4: sliding
    and full layers differ); all groups share one pool of page ids.
    """
    check_config(config)
    storage = kv_dtype or DType.from_torch(dtype)
    layers = _config_layers(config) if model is None else check_model(model)
    mla = config.model_type in _MLA
    specs: dict[str, KVCacheSpec] = {}
    for i, layer in layers.items():  # attention layers first: their groups come first
        specs[str(i)] = _layer_spec(layer, page_size, storage, mla)
    spec_tokens = int(params_kwargs.get("num_eagle_speculative_tokens", 0) or 0)
    for i, spec in (_state_specs(model, dtype, page_size, spec_tokens) if model is not None else {}).items():
        specs[f"state{i}"] = spec
    groups = group_layer_specs(specs, by_shape=True)  # (state rows have their own pool: no page growth)
    devices = [device_ref(device or torch.device("cpu"))]
    q_heads = {layer.q_heads for layer in layers.values()}  # the modules' (a config may say otherwise)
    num_q_heads = q_heads.pop() if len(q_heads) == 1 else getattr(config, "num_attention_heads", None)
    extra: dict[str, Any] = dict(kvcache_quant_config=quantization, num_q_heads=num_q_heads)
    extra.update(params_kwargs)
    layer_map = {int(n): (g, j) for g, (names, _) in enumerate(groups) for j, n in enumerate(names) if n.isdigit()}
    state_map = {
        int(n[5:]): (g, j) for g, (names, _) in enumerate(groups) for j, n in enumerate(names) if n.startswith("state")
    }
    config_view = KVCacheConfig(1, [], [KVCacheGroupSpec(names, spec) for names, spec in groups])
    tree = params_from_kv_cache_config(config_view, devices, **extra)
    if len(groups) == 1 and not state_map:
        return KVLayout(tree.leaves()[0], layer_map)
    return KVLayout(tree, layer_map, state_map)


def _state_specs(model: torch.nn.Module, dtype: torch.dtype, page_size: int, drafts: int) -> dict[int, MambaSpec]:
    """Layer index -> the `MambaSpec` of each recurrent mixer of `model` (`pagedkv.hf.mixers`)."""
    from pagedkv.hf.mixers import adapter_for

    out = {}
    for idx, (_, module) in sorted(state_modules(model).items()):
        adapter = adapter_for(module)
        assert adapter is not None
        shapes, dtypes = adapter.state_spec(module, dtype)
        stored = tuple(DType.from_torch(d) for d in dtypes)
        out[idx] = MambaSpec(block_size=page_size, shapes=shapes, dtypes=stored, mamba_type=adapter.mamba_type,
                             num_speculative_blocks=drafts)  # fmt: skip
    return out


def kv_params_from_config(config: Any, **kwargs: Any) -> KVCacheParams | MultiKVCacheParams:
    """`kv_layout(config, **kwargs).params`."""
    return kv_layout(config, **kwargs).params
