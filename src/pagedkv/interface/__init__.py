"""vLLM's `vllm.v1.kv_cache_interface` for pagedkv: per-layer specs, groups, and the shared pool layout.

`MambaSpec` describes a recurrent layer's state (one slot per request, a page
of its group). Specs and configs are torch-free frozen dataclasses (`reshape_kv_cache` imports
torch when called). `params_from_kv_cache_config` / `kv_cache_config_from_params`
convert between a `KVCacheConfig` and the `MultiKVCacheParams` tree the
managers take: one child per group. They live in `pagedkv.params.bridge`, which builds on this
package's configs, and load from it on first use (so neither package imports the other when imported).
"""

from pagedkv.interface.config import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layer_kv_cache_shape_bytes,
    get_kv_cache_config,
    group_layer_specs,
    num_states_for,
    reshape_kv_cache,
    unify_state_block_size,
)
from pagedkv.lazy import lazy_exports
from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SchedulerLimits,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
    kv_cache_uses_per_token_head_scales,
)

_BRIDGE = "pagedkv.params.bridge"
__getattr__, __dir__ = lazy_exports(
    __name__,
    {"kv_cache_config_from_params": _BRIDGE, "params_from_kv_cache_config": _BRIDGE, "spec_from_params": _BRIDGE},
    globals(),
)

__all__ = [
    "AttentionSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "FullAttentionSpec", "HiddenStateCacheSpec",
    "KVCacheConfig", "KVCacheGroupSpec", "KVCacheLayout", "KVCacheSpec", "KVCacheTensor", "KVQuantMode",
    "MLAAttentionSpec", "MambaSpec", "SchedulerLimits", "SinkFullAttentionSpec", "SlidingWindowMLASpec", "SlidingWindowSpec",
    "TQFullAttentionSpec", "UniformTypeKVCacheSpecs", "compute_layer_kv_cache_shape_bytes", "get_kv_cache_config",
    "get_kv_quant_mode", "group_layer_specs", "kv_cache_config_from_params", "kv_cache_uses_per_token_head_scales", "num_states_for",
    "params_from_kv_cache_config", "reshape_kv_cache", "spec_from_params", "unify_state_block_size",
]  # fmt: skip
