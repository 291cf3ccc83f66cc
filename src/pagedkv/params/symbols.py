"""Symbolic descriptions of the KV cache graph inputs (no torch needed).

`KVCacheParams.get_symbolic_inputs()` returns these so a graph builder (or a
CUDA-graph capture) can declare its inputs before any tensor exists. Static
dims are ints, symbolic dims are strings such as ``"replica_0_batch_size"``.
They flatten in exactly the order of the runtime inputs
(`pagedkv.manager.KVCacheInputs.flatten`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.dtype import DeviceRef, DType
from pagedkv.params.records import InputTree, RecordMixin, TreeMapMixin

__all__ = [
    "TensorSpec",
    "KVCacheInputSymbols",
    "RaggedKVCacheInputSymbols",
    "PaddedKVCacheInputSymbols",
    "MultiKVCacheInputSymbols",
    "StateCacheInputSymbols",
    "ragged_symbols",
    "state_symbols",
]

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    """Name, element type, shape (ints static, strings symbolic) and device of one input."""

    name: str
    dtype: DType
    shape: tuple[Dim, ...]
    device: DeviceRef

    @property
    def static_dims(self) -> tuple[int | None, ...]:
        """The shape with every symbolic dim replaced by None."""
        return tuple(d if isinstance(d, int) else None for d in self.shape)


class KVCacheInputSymbols(InputTree[TensorSpec]):
    """Base of the symbolic input records, and the per-device container (`.inputs`)."""


@dataclass(eq=False)
class RaggedKVCacheInputSymbols(RecordMixin, KVCacheInputSymbols):
    """Symbols of one device's `RaggedKVCacheInputs`."""

    blocks: TensorSpec
    cache_lengths: TensorSpec
    lookup_table: TensorSpec
    max_lengths: TensorSpec
    kv_scales: TensorSpec | None = None


@dataclass(eq=False)
class StateCacheInputSymbols(RecordMixin, KVCacheInputSymbols):
    """Symbols of one device's `StateCacheInputs` (a state group)."""

    blocks: TensorSpec
    cache_lengths: TensorSpec
    state_slots: TensorSpec
    has_initial_state: TensorSpec


@dataclass(eq=False)
class PaddedKVCacheInputSymbols(RecordMixin, KVCacheInputSymbols):
    """Symbols of one device's `PaddedKVCacheInputs`."""

    k_cache: TensorSpec
    v_cache: TensorSpec
    start_pos: TensorSpec
    null_op: TensorSpec


class MultiKVCacheInputSymbols(TreeMapMixin, KVCacheInputSymbols):
    """A named tree of symbol sets, one per cache of a `MultiKVCacheParams`."""

    def __init__(self, children: Mapping[str, KVCacheInputSymbols]) -> None:
        super().__init__(self._init_children(children))


def ragged_symbols(params: Any, prefix: str = "") -> KVCacheInputSymbols:
    """The symbolic per-device inputs of a `KVCacheParams` (see `KVCacheParams.get_symbolic_inputs`)."""
    records: list[KVCacheInputSymbols] = []
    for r, devices in enumerate(params.devices_per_replica):
        batch, pages = f"replica_{r}_batch_size", f"replica_{r}_max_num_pages"
        for s, device in enumerate(devices):
            tag = f"{prefix}r{r}_s{s}_"
            scales = None
            if params.quantized_kv_cache:
                scale_shape: tuple[Dim, ...] = ("total_num_pages", *params.shape_per_scale_block)
                scales = TensorSpec(f"{tag}kv_scales", params.kvcache_quant_config.scale_dtype, scale_shape, device)
            records.append(
                RaggedKVCacheInputSymbols(
                    blocks=TensorSpec(
                        f"{tag}kv_blocks", params.dtype, ("total_num_pages", *params.shape_per_block), device
                    ),
                    cache_lengths=TensorSpec(f"{tag}cache_lengths", DType.int32, (batch,), device),
                    lookup_table=TensorSpec(f"{tag}lookup_table", DType.int32, (batch, pages), device),
                    max_lengths=TensorSpec(f"{tag}max_lengths", DType.int32, ("num_steps", 2), DeviceRef.CPU()),
                    kv_scales=scales,
                )
            )
    return KVCacheInputSymbols(records)


def state_symbols(params: Any, prefix: str = "") -> KVCacheInputSymbols:
    """The symbolic per-device inputs of a `StateCacheParams` group, in the order of its `StateCacheInputs`:
    uint8 pages, cache lengths [B], slots [B, 1 + drafts] and has_initial_state bool [B]."""
    records: list[KVCacheInputSymbols] = []
    slots = params.state_spec.slots_per_request
    for r, devices in enumerate(params.devices_per_replica):
        batch = f"replica_{r}_batch_size"
        for s, device in enumerate(devices):
            tag = f"{prefix}r{r}_s{s}_"
            records.append(
                StateCacheInputSymbols(
                    blocks=TensorSpec(
                        f"{tag}state_blocks", DType.uint8, ("total_num_pages", *params.shape_per_block), device
                    ),  # fmt: skip
                    cache_lengths=TensorSpec(f"{tag}cache_lengths", DType.int32, (batch,), device),
                    state_slots=TensorSpec(f"{tag}state_slots", DType.int32, (batch, slots), device),
                    has_initial_state=TensorSpec(f"{tag}has_initial_state", DType.bool, (batch,), device),
                )
            )
    return KVCacheInputSymbols(records)
