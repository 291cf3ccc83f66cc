"""The parameter layer: what a cache is, described before any page or tensor exists (torch-free).

    kv               KVCacheParams (one group of layers), KVCacheQuantizationConfig, KVConnectorType,
                     BatchCharacteristics, KVCacheParamInterface (these names are this package's exports)
    multi            MultiKVCacheParams: a tree of params, one child per group
    state            StateCacheParams: a group of recurrent state layers
    connector        KVConnectorConfig: the tiers below the device (host, disk, Redis)
    symbols          the symbolic inputs a params object describes (TensorSpec, *InputSymbols)
    records          the record and tree mixins of the inputs and symbols
    validation       the argument checks every layer shares
    deployment_seed  the deployment's secret hash seed
    bridge           vLLM's KVCacheConfig <-> params trees

`allocate_buffers` on the params is the one call that reaches up (to `pagedkv.runtime`), lazily.
"""

from __future__ import annotations

from pagedkv.lazy import lazy_exports

__all__ = [
    "HASH_ALGOS",
    "BatchCharacteristics",
    "KVCacheParamInterface",
    "KVCacheParams",
    "KVCacheQuantizationConfig",
    "KVConnectorType",
    "split_into_groups",
]

# Names load on first use (PEP 562): importing a submodule (`validation` from the bookkeeping, say) runs
# this file without loading `kv`. Inside pagedkv, modules import from `pagedkv.params.kv` itself.
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "pagedkv.params.kv"), globals())
