"""`MultiKVCacheParams`: several KV caches that page one sequence with one block table.

A model with a draft head, or with layers whose caches differ in shape, has
one `KVCacheParams` per cache. They share page ids, page size, parallelism
and prefix-caching policy, so `bytes_per_block` is the sum over the leaves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.dtype import DeviceRef
from pagedkv.params.kv import KVCacheParamInterface, KVCacheParams, KVConnectorType
from pagedkv.params.symbols import MultiKVCacheInputSymbols

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.runtime.buffers import MultiKVCacheBuffer

__all__ = ["MultiKVCacheParams", "KVCacheParamInterface"]

# Attributes every cache of one model must agree on, with the error wording.
_SHARED = (
    ("page_size", "page size"),
    ("data_parallel_degree", "data parallel degree"),
    ("devices", "devices"),
    ("enable_prefix_caching", "enable_prefix_caching"),
    ("kv_connector", "kv_connector"),
    ("kv_connector_config", "kv_connector_config"),
    ("host_kvcache_swap_space_gb", "host_kvcache_swap_space_gb"),
    ("num_eagle_speculative_tokens", "num_eagle_speculative_tokens"),
    ("kv_hash_algo", "kv_hash_algo"),
    ("kv_hash_seed", "kv_hash_seed"),
    ("eviction_policy", "eviction_policy"),
    ("protected_fraction", "protected_fraction"),
    ("evict_leaves_first", "evict_leaves_first"),
    ("enable_partial_page_reuse", "enable_partial_page_reuse"),
    ("commit_on_alloc", "commit_on_alloc"),
    ("weights_version", "weights_version"),
    ("max_state_checkpoints", "max_state_checkpoints"),
)


@dataclass(frozen=True)
class MultiKVCacheParams(KVCacheParamInterface):
    """A named tree of caches (`KVCacheParams` leaves, or nested trees) sharing one page table."""

    children: Mapping[str, KVCacheParams | MultiKVCacheParams]

    def __post_init__(self) -> None:
        if not isinstance(self.children, Mapping):
            raise TypeError(f"children must be a mapping name -> KVCacheParams, got {type(self.children).__name__}")
        if not self.children:
            raise ValueError("MultiKVCacheParams requires at least one param")
        for name, child in self.children.items():
            if not isinstance(name, str):
                raise TypeError(f"children key {name!r} must be a str")
            if not isinstance(child, KVCacheParams | MultiKVCacheParams):
                raise TypeError(
                    f"children[{name!r}]={type(child).__name__} must be KVCacheParams or MultiKVCacheParams"
                )
        object.__setattr__(self, "children", dict(self.children))
        leaves = self.leaves()
        first = leaves[0]
        for leaf in leaves[1:]:
            for attr, words in _SHARED:
                if getattr(leaf, attr) != getattr(first, attr):
                    raise ValueError(
                        f"All caches must have the same {words}: {getattr(first, attr)!r} != {getattr(leaf, attr)!r}"
                    )

    def leaves(self) -> list[KVCacheParams]:
        """Every `KVCacheParams` in tree (depth-first, dict) order."""
        return [leaf for child in self.children.values() for leaf in child.leaves()]

    def _first(self) -> KVCacheParams:
        return self.leaves()[0]

    @property
    def page_size(self) -> int:
        """Tokens per page (shared by every cache)."""
        return self._first().page_size

    @property
    def data_parallel_degree(self) -> int:
        """Data-parallel replicas (shared)."""
        return self._first().data_parallel_degree

    @property
    def devices(self) -> Sequence[DeviceRef]:
        """Devices (shared)."""
        return self._first().devices

    @property
    def n_devices(self) -> int:
        """Number of devices (shared)."""
        return self._first().n_devices

    @property
    def tensor_parallel_degree(self) -> int:
        """Devices per replica (shared)."""
        return self._first().tensor_parallel_degree

    @property
    def devices_per_replica(self) -> list[list[DeviceRef]]:
        """Devices of each replica (shared)."""
        return self._first().devices_per_replica

    @property
    def enable_prefix_caching(self) -> bool:
        """Prefix caching policy (shared)."""
        return self._first().enable_prefix_caching

    @property
    def kv_connector(self) -> KVConnectorType | None:
        """Connector type (shared)."""
        return self._first().kv_connector

    @property
    def kv_connector_config(self) -> Any:
        """Settings of the tiers below the device (shared)."""
        return self._first().kv_connector_config

    @property
    def host_kvcache_swap_space_gb(self) -> float | None:
        """Host swap space (shared)."""
        return self._first().host_kvcache_swap_space_gb

    @property
    def num_eagle_speculative_tokens(self) -> int:
        """Draft slots reserved per request (shared)."""
        return self._first().num_eagle_speculative_tokens

    @property
    def kv_hash_algo(self) -> str:
        """Prefix hash algorithm (shared)."""
        return self._first().kv_hash_algo

    @property
    def eviction_policy(self) -> str:
        """Eviction policy of the shared pool."""
        return self._first().eviction_policy

    @property
    def evict_leaves_first(self) -> bool:
        """Whether the shared pool evicts prefix-chain leaves first."""
        return self._first().evict_leaves_first

    @property
    def weights_version(self) -> str | None:
        """The weights version every leaf's hash chains start from."""
        return self._first().weights_version

    @property
    def commit_on_alloc(self) -> bool | None:
        """Pages become hittable at `alloc` rather than at `step` (shared; None: on with prefix caching for a
        model of one group)."""
        return self._first().commit_on_alloc

    @property
    def enable_partial_page_reuse(self) -> bool:
        """Copy-on-write reuse of a cached last partial page (shared)."""
        return self._first().enable_partial_page_reuse

    @property
    def max_state_checkpoints(self) -> int | None:
        """State checkpoints kept for prefix hits (shared by every cache)."""
        return self._first().max_state_checkpoints

    @property
    def protected_fraction(self) -> float:
        """Share of the shared pool the protected list may hold."""
        return self._first().protected_fraction

    @property
    def kv_hash_seed(self) -> bytes | None:
        """Prefix hash seed (shared)."""
        return self._first().kv_hash_seed

    @property
    def bytes_per_block(self) -> int:
        """Sum over the caches: one page id holds a page in every cache."""
        return sum(leaf.bytes_per_block for leaf in self.leaves())

    @property
    def bytes_per_token(self) -> int:
        """`bytes_per_block / page_size` rounded up."""
        return -(-self.bytes_per_block // self.page_size)

    def copy_as_dp_1(self, replica_idx: int = 0) -> MultiKVCacheParams:
        """Every leaf restricted to replica `replica_idx`."""
        return MultiKVCacheParams({k: c.copy_as_dp_1(replica_idx) for k, c in self.children.items()})

    def allocate_buffers(self, total_num_pages: int) -> list[MultiKVCacheBuffer]:
        """One `MultiKVCacheBuffer` tree per replica, `total_num_pages` pages in every cache."""
        from pagedkv.runtime.buffers import allocate_multi_kv_buffers

        return allocate_multi_kv_buffers(self, total_num_pages)

    def get_symbolic_inputs(self, prefix: str = "") -> MultiKVCacheInputSymbols:
        """A tree of symbolic inputs matching `runtime_inputs`, children in dict order."""
        return MultiKVCacheInputSymbols(
            {name: child.get_symbolic_inputs(f"{prefix}{name}.") for name, child in self.children.items()}
        )
