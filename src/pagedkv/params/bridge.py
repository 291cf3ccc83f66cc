"""`KVCacheConfig` <-> `MultiKVCacheParams`: two views of one hybrid cache.

A group of the config is a child of the params tree named ``group{i}``, its
`num_layers` the group's layer count, its attention fields (`sliding_window`,
`attention_chunk_size`, `sink_tokens`, `is_cross_attention`, `is_mla`) taken
from the group's spec. A `MambaSpec` group becomes a
`StateCacheParams` child. Children that are not all full attention make the
tree *hybrid*: each child gets its own page table over one shared pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.dtype import DeviceRef
from pagedkv.interface.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)

__all__ = ["spec_from_params", "params_from_kv_cache_config", "kv_cache_config_from_params"]


def spec_from_params(params: KVCacheParams) -> KVCacheSpec:
    """The per-layer spec of one cache (`KVCacheParams.kv_cache_spec`; page bytes are per layer and per
    replica's whole TP group): an attention spec, or the `MambaSpec` of a `StateCacheParams` group."""
    return params.kv_cache_spec


def _leaf_from_spec(spec: KVCacheSpec, num_layers: int, devices: Sequence[DeviceRef], **kwargs: Any) -> KVCacheParams:
    kwargs = dict(kwargs)
    if isinstance(spec, MambaSpec):
        kwargs.pop("num_q_heads", None)
        kwargs.pop("kvcache_quant_config", None)
        return StateCacheParams.from_spec(spec, num_layers, devices, **kwargs)
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"pagedkv pages attention layers only, got {type(spec).__name__}")
    is_mla = spec.kv_dim == 1
    q_heads = kwargs.pop("num_q_heads", len(devices) if is_mla else None)
    window = getattr(spec, "sliding_window", None)
    if isinstance(spec, FullAttentionSpec) and spec.kind == "full":
        window = None  # a recorded window is computed, not allocated
    return KVCacheParams(
        dtype=spec.dtype, n_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, num_layers=num_layers,
        devices=devices, page_size=spec.block_size, is_mla=is_mla, num_q_heads=q_heads,
        sliding_window=window, attention_chunk_size=getattr(spec, "attention_chunk_size", None)
        if isinstance(spec, ChunkedLocalAttentionSpec) else None,
        sink_tokens=getattr(spec, "sink_len", 0) if spec.kind == "sink" else 0,
        is_cross_attention=isinstance(spec, CrossAttentionSpec), **kwargs,
    )  # fmt: skip


def params_from_kv_cache_config(
    config: KVCacheConfig, devices: Sequence[DeviceRef], **params_kwargs: Any
) -> MultiKVCacheParams:
    """A params tree with one child ``group{i}`` per group; `params_kwargs` go to every child
    (e.g. ``enable_prefix_caching=True``)."""
    return MultiKVCacheParams(
        {
            f"group{i}": _leaf_from_spec(g.kv_cache_spec, len(g.layer_names), devices, **params_kwargs)
            for i, g in enumerate(config.kv_cache_groups)
        }
    )


def kv_cache_config_from_params(params: KVCacheParams | MultiKVCacheParams, num_blocks: int) -> KVCacheConfig:
    """The config of a params tree: one group per leaf, layers named ``{child}.{index}``."""
    leaves = {"cache": params} if isinstance(params, KVCacheParams) else _named_leaves(params)
    groups = [
        KVCacheGroupSpec([f"{name}.{i}" for i in range(leaf.num_layers)], spec_from_params(leaf))
        for name, leaf in leaves.items()
    ]
    slots = max(leaf.num_layers for leaf in leaves.values())
    page = max(spec_from_params(leaf).page_size_bytes for leaf in leaves.values())
    shared_by = [[g.layer_names[j] for g in groups if j < len(g.layer_names)] for j in range(slots)]
    return KVCacheConfig(num_blocks, [KVCacheTensor(num_blocks * page * slots, shared_by)], groups)


def _named_leaves(tree: MultiKVCacheParams, prefix: str = "") -> dict[str, KVCacheParams]:
    out: dict[str, KVCacheParams] = {}
    for name, child in tree.children.items():
        if isinstance(child, MultiKVCacheParams):
            out.update(_named_leaves(child, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = child
    return out
