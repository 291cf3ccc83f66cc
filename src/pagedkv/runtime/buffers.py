"""Page buffers of one data-parallel replica, and their byte views for offload.

One `KVCacheBuffer` per replica holds one values tensor per TP shard (plus
FP8 scales). `to_memory()` re-views every tensor as ``uint8 [num_pages,
bytes_per_page]`` sharing its storage, so transfer code can move any page of
any cache the same way, whatever its dtype or layout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.params.validation import INT32_MAX, check_int

__all__ = [
    "KVCacheBuffer",
    "KVCacheMemory",
    "MultiKVCacheBuffer",
    "ReplicatedKVCacheMemory",
    "allocate_kv_buffers",
    "check_fits",
    "allocate_multi_kv_buffers",
]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``uint8 [pages, bytes_per_page]`` view of a page tensor whose pages are each contiguous (shares storage)."""
    if tensor.is_contiguous():
        return tensor.view(torch.uint8).view(tensor.shape[0], -1)
    raw = tensor.view(torch.uint8)  # the last dim is contiguous: only its width changes
    page_bytes = tensor[0].numel() * tensor.element_size()
    return raw.as_strided((tensor.shape[0], page_bytes), (raw.stride(0), 1))


def _pages_contiguous(t: torch.Tensor) -> bool:
    """True when each page t[i] is one contiguous block (pages may be spaced further apart)."""
    return t.is_contiguous() or (t[0].is_contiguous() and t.stride(0) >= t[0].numel())


@dataclass(eq=False)
class KVCacheMemory:
    """One offload-ready unit: a 2-D uint8 ``[num_pages, bytes_per_page]`` view."""

    buffer: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(self.buffer).__name__}")
        if self.buffer.dim() != 2 or self.buffer.dtype != torch.uint8:
            raise ValueError(
                f"buffer must be 2-D uint8 [num_pages, bytes_per_page], got {self.buffer.dtype} {tuple(self.buffer.shape)}"
            )

    @property
    def num_pages(self) -> int:
        """Pages in the unit (null page included)."""
        return self.buffer.shape[0]

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page in the unit."""
        return self.buffer.shape[1]


@dataclass(eq=False)
class ReplicatedKVCacheMemory(KVCacheMemory):
    """A unit whose pages are identical on every TP shard: `buffer` (rank 0) plus `peers`."""

    peers: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.peers:
            raise ValueError("ReplicatedKVCacheMemory requires at least 1 peer")
        for i, peer in enumerate(self.peers):
            if peer.shape != self.buffer.shape or peer.dtype != self.buffer.dtype:
                raise ValueError(
                    f"peers[{i}] is {peer.dtype} {tuple(peer.shape)}; rank 0 is {self.buffer.dtype} {tuple(self.buffer.shape)}"
                )


def _check_uniform(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kind}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{kind}[{i}] has dtype {t.dtype}; KV pages and scales are floating point")
        if t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(f"{kind}[{i}] must have at least one page, got shape {tuple(t.shape)}")
        if not _pages_contiguous(t):
            raise ValueError(f"{kind}[{i}] must be contiguous (each page at least)")
        if (t.dtype, t.shape) != (tensors[0].dtype, tensors[0].shape):
            raise ValueError(
                f"All {kind} buffers must have the same dtype and shape: "
                f"{kind}[0] is {tensors[0].dtype} {tuple(tensors[0].shape)}, {kind}[{i}] is {t.dtype} {tuple(t.shape)}"
            )
    pinned = {t.device.type == "cpu" and t.is_pinned() for t in tensors}
    if len(pinned) > 1:
        raise ValueError(f"{kind} buffers mix pinned and unpinned host memory")


@dataclass(eq=False)
class KVCacheBuffer:
    """The page buffers of one replica: `values[s]` (and `scales[s]`) for TP shard s.

    `replicates_kv_across_tp` is True when every shard holds the same pages (MLA).
    """

    replicates_kv_across_tp: bool
    values: list[torch.Tensor]
    scales: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.replicates_kv_across_tp, bool):
            raise TypeError(f"replicates_kv_across_tp={self.replicates_kv_across_tp!r} must be a bool")
        for kind, tensors in (("values", self.values), ("scales", self.scales)):
            if not isinstance(tensors, list | tuple) and (kind == "values" or tensors is not None):
                raise TypeError(f"{kind} must be a list of tensors (one per TP shard), got {type(tensors).__name__}")
        self.values = list(self.values)
        if not self.values:
            raise ValueError("KVCacheBuffer requires at least one values buffer")
        if self.replicates_kv_across_tp and len(self.values) < 2:
            raise ValueError(f"replicates_kv_across_tp=True requires at least 2 TP shards, got {len(self.values)}")
        _check_uniform("values", self.values)
        if self.scales is None:
            return
        self.scales = list(self.scales)
        if len(self.scales) != len(self.values):
            raise ValueError(f"scales has {len(self.scales)} buffers but values has {len(self.values)}")
        _check_uniform("scales", self.scales)
        if self.scales[0].shape[0] != self.values[0].shape[0]:
            raise ValueError(
                f"Values and scales must have the same number of pages: {self.values[0].shape[0]} != {self.scales[0].shape[0]}"
            )
        for i, (v, s) in enumerate(zip(self.values, self.scales, strict=True)):
            if v.device != s.device:
                raise ValueError(f"values[{i}] is on {v.device} but scales[{i}] is on {s.device}")

    @property
    def all_buffers(self) -> list[torch.Tensor]:
        """Every values buffer, then every scales buffer."""
        return [*self.values, *(self.scales or [])]

    @property
    def total_num_pages(self) -> int:
        """Pages per buffer (null page included)."""
        return self.values[0].shape[0]

    @property
    def page_size(self) -> int:
        """Tokens per page, read from the layout, so a connector can offload the cache
        without its `KVCacheParams`: dim 3 of values laid out
        ``[pages, kv_dim, num_layers, page_size, heads, head_dim]`` (what `allocate_buffers` makes).
        ValueError for values of another rank, whose page size the buffer alone does not say."""
        shape = tuple(self.values[0].shape)
        if len(shape) != 6:
            raise ValueError(
                f"page_size needs values shaped [pages, kv_dim, num_layers, page_size, heads, head_dim]; got {shape}"
            )
        return int(shape[3])

    def to_memory(self) -> list[KVCacheMemory]:
        """Offload units: values then scales; one unit per shard, or one replicated unit per kind."""
        units: list[KVCacheMemory] = []
        for tensors in (self.values, self.scales or []):
            if not tensors:
                continue
            views = [byte_view(t) for t in tensors]
            if self.replicates_kv_across_tp:
                units.append(ReplicatedKVCacheMemory(buffer=views[0], peers=views[1:]))
            else:
                units.extend(KVCacheMemory(buffer=v) for v in views)
        return units


@dataclass(eq=False)
class MultiKVCacheBuffer:
    """One replica's buffers of a multi-cache model, one child per cache, in tree order."""

    children: Mapping[str, KVCacheBuffer | MultiKVCacheBuffer]

    @property
    def all_buffers(self) -> list[torch.Tensor]:
        """Every child's buffers, in tree order."""
        return [b for child in self.children.values() for b in child.all_buffers]

    @property
    def total_num_pages(self) -> int:
        """Pages per buffer (shared by every cache)."""
        return next(iter(self.children.values())).total_num_pages

    @property
    def page_size(self) -> int:
        """Tokens per page (shared by every cache; see `KVCacheBuffer.page_size`)."""
        return next(iter(self.children.values())).page_size

    def to_memory(self) -> list[KVCacheMemory]:
        """Every child's units, concatenated in tree order."""
        return [u for child in self.children.values() for u in child.to_memory()]

    def leaves(self) -> list[KVCacheBuffer]:
        """The `KVCacheBuffer` of every cache, in tree order."""
        return [
            leaf
            for child in self.children.values()
            for leaf in (child.leaves() if isinstance(child, MultiKVCacheBuffer) else [child])
        ]


def _device_memory(device: torch.device) -> int | None:
    """Bytes a device has (CPU: physical memory); None when unknown or unlimited (meta)."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - platform dependent
            return None
    if device.type == "cuda" and torch.cuda.is_available():  # pragma: no cover - needs a GPU
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def check_fits(params: KVCacheParams | MultiKVCacheParams, total_num_pages: int, *, null_page: bool = False,
               shared: bool = False, host_bytes_per_page: int = 0) -> None:  # fmt: skip
    """ValueError unless `total_num_pages` pages (page ids are int32; + the null page if `null_page`) of
    every cache fit each device's memory.

    `shared`: the caches alias one arena (a hybrid model), so a page costs the largest cache's page;
    `host_bytes_per_page`: bookkeeping per page in host memory. Nothing is allocated.
    """
    check_int("total_num_pages", total_num_pages, 1, INT32_MAX - null_page)
    rows = total_num_pages + null_page
    need: dict[torch.device, int] = {}
    for leaf in params.leaves():
        for device in leaf.devices:
            dev, page = device.to_torch(), leaf.bytes_per_block_per_device
            need[dev] = max(need.get(dev, 0), page) if shared else need.get(dev, 0) + page
    cpu = torch.device("cpu")
    need[cpu] = need.get(cpu, 0) + host_bytes_per_page
    for dev, per_page in need.items():
        have = _device_memory(dev)
        if have is not None and per_page * rows > have:
            raise ValueError(f"total_num_pages={total_num_pages} of {per_page} bytes need "
                             f"{per_page * rows} bytes on {dev}, which has {have}")  # fmt: skip


def allocate_kv_buffers(params: KVCacheParams, total_num_pages: int) -> list[KVCacheBuffer]:
    """Zeroed ``[total_num_pages, *shape_per_block]`` buffers on every device, one `KVCacheBuffer` per replica."""
    check_fits(params, total_num_pages)
    dtype = params.dtype.to_torch()
    buffers = []
    for devices in params.devices_per_replica:
        values = [
            torch.zeros([total_num_pages, *params.shape_per_block], dtype=dtype, device=d.to_torch()) for d in devices
        ]
        scales = None
        if params.quantized_kv_cache:
            assert params.kvcache_quant_config is not None
            scale_dtype = params.kvcache_quant_config.scale_dtype.to_torch()
            shape = [total_num_pages, *params.shape_per_scale_block]
            scales = [torch.zeros(shape, dtype=scale_dtype, device=d.to_torch()) for d in devices]
        buffers.append(KVCacheBuffer(params.replicates_kv_across_tp, values, scales))
    return buffers


def allocate_multi_kv_buffers(params: MultiKVCacheParams, total_num_pages: int) -> list[MultiKVCacheBuffer]:
    """One `MultiKVCacheBuffer` per replica, every cache with `total_num_pages` pages."""
    per_child = {name: child.allocate_buffers(total_num_pages) for name, child in params.children.items()}
    return [
        MultiKVCacheBuffer({name: bufs[r] for name, bufs in per_child.items()})
        for r in range(params.data_parallel_degree)
    ]
