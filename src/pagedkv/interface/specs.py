"""vLLM's KV cache specs under their `kv_cache_interface` module path (they live in `pagedkv.specs`)."""

from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVQuantMode,
    MLAAttentionSpec,
    SchedulerLimits,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    attention_spec,
    get_kv_quant_mode,
    kv_cache_uses_per_token_head_scales,
)

__all__ = [
    "AttentionSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "FullAttentionSpec", "HiddenStateCacheSpec",
    "KVCacheSpec", "KVQuantMode", "MLAAttentionSpec", "SchedulerLimits", "SinkFullAttentionSpec",
    "SlidingWindowMLASpec", "SlidingWindowSpec", "TQFullAttentionSpec", "UniformTypeKVCacheSpecs", "attention_spec",
    "get_kv_quant_mode", "kv_cache_uses_per_token_head_scales",
]  # fmt: skip
