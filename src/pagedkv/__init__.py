"""pagedkv: a paged KV cache manager for LLM inference engines, on PyTorch.

Names load on first use, so ``import pagedkv`` is cheap and the bookkeeping
classes (params, contexts, block pool) never pull in torch; the tensor-side
classes import it when first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "DType": "pagedkv.dtype",
    "DeviceRef": "pagedkv.dtype",
    "KVCacheParams": "pagedkv.params.kv",
    "KVCacheParamInterface": "pagedkv.params.kv",
    "BatchCharacteristics": "pagedkv.params.kv",
    "KVCacheQuantizationConfig": "pagedkv.params.kv",
    "KVConnectorType": "pagedkv.params.kv",
    "KVConnectorConfig": "pagedkv.params.connector",
    "MultiKVCacheParams": "pagedkv.params.multi",
    "StateCacheParams": "pagedkv.params.state",
    "MambaSpec": "pagedkv.specs",
    "TensorSpec": "pagedkv.params.symbols",
    "KVCacheInputSymbols": "pagedkv.params.symbols",
    "RaggedKVCacheInputSymbols": "pagedkv.params.symbols",
    "PaddedKVCacheInputSymbols": "pagedkv.params.symbols",
    "MultiKVCacheInputSymbols": "pagedkv.params.symbols",
    "InsufficientBlocksError": "pagedkv.core.errors",
    "IntegrityError": "pagedkv.core.errors",
    "MissingPagesError": "pagedkv.core.errors",
    "TextContext": "pagedkv.core.context",
    "Retention": "pagedkv.core.context",
    "TokenBuffer": "pagedkv.core.context",
    "KVCacheMetrics": "pagedkv.core.metrics",
    "BlockPool": "pagedkv.core.pool",
    "BlockManager": "pagedkv.core.block_manager",
    "hash_tokens": "pagedkv.core.hashing",
    "compute_num_device_blocks": "pagedkv.core.memory",
    "compute_num_host_blocks": "pagedkv.core.memory",
    "estimated_memory_size": "pagedkv.core.memory",
    "infer_optimal_batch_size": "pagedkv.core.memory",
    "compute_max_seq_len_fitting_in_cache": "pagedkv.core.memory",
    "KVCacheBuffer": "pagedkv.runtime.buffers",
    "MultiKVCacheBuffer": "pagedkv.runtime.buffers",
    "KVCacheMemory": "pagedkv.runtime.buffers",
    "ReplicatedKVCacheMemory": "pagedkv.runtime.buffers",
    "KVCacheInputs": "pagedkv.runtime.inputs",
    "RaggedKVCacheInputs": "pagedkv.runtime.inputs",
    "PaddedKVCacheInputs": "pagedkv.runtime.inputs",
    "KVCacheInputsSequence": "pagedkv.runtime.inputs",
    "MultiKVCacheInputs": "pagedkv.runtime.inputs",
    "StateCacheInputs": "pagedkv.runtime.inputs",
    "StateCacheBuffer": "pagedkv.runtime.state_buffers",
    "KVCacheManager": "pagedkv.manager.base",
    "ContinuousBatchingKVCacheManager": "pagedkv.manager.continuous",
    "PagedKVCacheManager": "pagedkv.manager.paged",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from pagedkv.core.block_manager import BlockManager
    from pagedkv.core.context import Retention, TextContext, TokenBuffer
    from pagedkv.core.errors import InsufficientBlocksError, IntegrityError, MissingPagesError
    from pagedkv.core.hashing import hash_tokens
    from pagedkv.core.memory import (
        compute_max_seq_len_fitting_in_cache,
        compute_num_device_blocks,
        compute_num_host_blocks,
        estimated_memory_size,
        infer_optimal_batch_size,
    )
    from pagedkv.core.metrics import KVCacheMetrics
    from pagedkv.core.pool import BlockPool
    from pagedkv.dtype import DeviceRef, DType
    from pagedkv.manager.base import KVCacheManager
    from pagedkv.manager.continuous import ContinuousBatchingKVCacheManager
    from pagedkv.manager.paged import PagedKVCacheManager
    from pagedkv.params.connector import KVConnectorConfig
    from pagedkv.params.kv import (
        BatchCharacteristics,
        KVCacheParamInterface,
        KVCacheParams,
        KVCacheQuantizationConfig,
        KVConnectorType,
    )
    from pagedkv.params.multi import MultiKVCacheParams
    from pagedkv.params.state import StateCacheParams
    from pagedkv.params.symbols import (
        KVCacheInputSymbols,
        MultiKVCacheInputSymbols,
        PaddedKVCacheInputSymbols,
        RaggedKVCacheInputSymbols,
        TensorSpec,
    )
    from pagedkv.runtime.buffers import KVCacheBuffer, KVCacheMemory, MultiKVCacheBuffer, ReplicatedKVCacheMemory
    from pagedkv.runtime.inputs import (
        KVCacheInputs,
        KVCacheInputsSequence,
        MultiKVCacheInputs,
        PaddedKVCacheInputs,
        RaggedKVCacheInputs,
        StateCacheInputs,
    )
    from pagedkv.runtime.state_buffers import StateCacheBuffer
    from pagedkv.specs import MambaSpec
