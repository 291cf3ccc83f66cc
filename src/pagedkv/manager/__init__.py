"""KV cache managers (MAX's `KVCacheManager` family and `PagedKVCacheManager`) and the inputs they hand to a model."""

from pagedkv.manager.base import KVCacheManager
from pagedkv.manager.continuous import ContinuousBatchingKVCacheManager
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.symbols import KVCacheInputSymbols
from pagedkv.runtime.inputs import (
    KVCacheInputs,
    KVCacheInputsSequence,
    MultiKVCacheInputs,
    PaddedKVCacheInputs,
    RaggedKVCacheInputs,
)

__all__ = [
    "ContinuousBatchingKVCacheManager",
    "KVCacheInputSymbols",
    "KVCacheInputs",
    "KVCacheInputsSequence",
    "KVCacheManager",
    "MultiKVCacheInputs",
    "PaddedKVCacheInputs",
    "PagedKVCacheManager",
    "RaggedKVCacheInputs",
]
