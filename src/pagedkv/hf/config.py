"""KV cache layout of a transformers model: params (one cache, or one group per attention type) and a layer map.

Layer types come from the config: ``layer_types`` ("full_attention",
"sliding_attention", "chunked_attention") where the model has them, else
every layer is sliding when ``sliding_window`` is set (Mistral, Mixtral,
Phi-3, Starcoder2) and full otherwise; DeepSeek V2/V3 cache one MLA latent (``kv_lora_rank +
qk_rope_head_dim``) per token. Mixed types are grouped as vLLM's hybrid
allocator groups them (`pagedkv.interface.group_layer_specs`): each group is
a child ``group{i}`` of a `MultiKVCacheParams`, and `layer_map[i]` says which
group and which layer slot of it layer i uses. Layers of one type whose K/V
shapes differ (Gemma 4's full layers have a larger head) are separate groups,
each with its own page shape over the one pool (`pagedkv.runtime.arena`).
Recurrent mixers (`pagedkv.hf.mixers`) give state layers: each gets a `MambaSpec`
from its mixer, the state groups (`StateCacheParams`) come after the attention
groups, and `state_map[i]` says which state group and slot layer i uses. The
attention page keeps `page_size`: state lives in rows of its own
(`pagedkv.core.checkpoints`), so, unlike vLLM's hybrid allocator
(`pagedkv.interface.unify_state_block_size`), no page grows to a state's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.dtype import DeviceRef, DType
from pagedkv.hf.support import check_config, check_model, kv_shapes, state_modules
from pagedkv.interface.bridge import params_from_kv_cache_config
from pagedkv.interface.config import KVCacheConfig, KVCacheGroupSpec, group_layer_specs
from pagedkv.multi_params import MultiKVCacheParams
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig
from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.state_params import StateCacheParams

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


def _layer_spec(config: Any, kind: str, page_size: int, dtype: DType, shape: tuple[int, int]) -> AttentionSpec:
    if config.model_type in _MLA:
        head = config.kv_lora_rank + config.qk_rope_head_dim
        return MLAAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=head, dtype=dtype)
    kv_heads, head_size = shape
    common: dict[str, Any] = dict(block_size=page_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
    if kind == "sliding_attention":
        return SlidingWindowSpec(**common, sliding_window=config.sliding_window)
    if kind == "chunked_attention":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=config.attention_chunk_size)
    if kind == "full_attention":
        return FullAttentionSpec(**common)
    raise ValueError(f"layer type {kind!r} is not supported")


def _layer_kinds(config: Any) -> list[str]:
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


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
    `model` (as `LLMEngine.from_hf` passes it), its modules are checked first and the K/V shape is the
    one they pass to attention (`pagedkv.hf.support.check_model`); without, it comes from the config.
    Layers are grouped by attention type and K/V shape, so a group's params carry its own ``n_kv_heads``
    and ``head_dim`` (Gemma 4: sliding and full layers differ); all groups share one pool of page ids.
    """
    check_config(config)
    storage = kv_dtype or DType.from_torch(dtype)
    kinds = _layer_kinds(config)
    specs: dict[str, KVCacheSpec] = {}
    if model is None:
        if any(k not in ("full_attention", "sliding_attention", "chunked_attention") for k in kinds):
            raise ValueError(f"model_type={config.model_type!r} has recurrent-state layers: pass model= to "
                             "kv_layout so their state shapes come from the modules")  # fmt: skip
        shapes = dict(enumerate(kv_shapes(config)))
    else:
        shapes = check_model(model)
    for i, shape in shapes.items():  # attention layers first: their groups come first
        kind = "full_attention" if kinds[i] == "hybrid" else kinds[i]  # Falcon-H1: attention beside a mixer
        specs[str(i)] = _layer_spec(config, kind, page_size, storage, shape)
    spec_tokens = int(params_kwargs.get("num_eagle_speculative_tokens", 0) or 0)
    for i, spec in (_state_specs(model, dtype, page_size, spec_tokens) if model is not None else {}).items():
        specs[f"state{i}"] = spec
    groups = group_layer_specs(specs, by_shape=True)  # (state rows have their own pool: no page growth)
    devices = [device_ref(device or torch.device("cpu"))]
    extra: dict[str, Any] = dict(
        kvcache_quant_config=quantization, num_q_heads=getattr(config, "num_attention_heads", None)
    )
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
