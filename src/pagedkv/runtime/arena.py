"""Page buffers of a hybrid model: every group's pages alias one byte arena per device.

A page id belongs to one group at a time, so all groups can view the same
memory: per device one ``uint8 [total_pages, arena_page_bytes]`` arena, where
`arena_page_bytes` is the largest group page (values + FP8 scales) on that
device. Group g's values are the first bytes of each arena row, its scales
follow::

    arena row p:  [ values of group owning p | scales | unused tail (smaller groups) ]

so one page id costs the largest group's page, not the sum over groups.
State groups (`StateCacheParams`) have an arena of their own, indexed by state
row (`core.state.checkpoints.StateCheckpoints`): each group's page sits at its own
offset of a row, so one row holds a request's whole recurrent state (a live
slot or a checkpoint), viewed as each layer's state tensors
(`pagedkv.runtime.state_buffers`)::

    state row r:  [ state group 0's page | state group 1's page | ... ]

Rows are padded to `ROW_ALIGN` (8) bytes, so every view of a row starts aligned
for its dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.core.memory import ROW_ALIGN
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.runtime.buffers import KVCacheBuffer, KVCacheMemory, MultiKVCacheBuffer
from pagedkv.runtime.state_buffers import make_state_buffer

__all__ = ["HybridKVCacheBuffer", "allocate_arena_buffers", "leaf_page_bytes"]


def leaf_page_bytes(leaf: KVCacheParams) -> int:
    """Bytes of one page of `leaf` on one device (values + scales)."""
    return leaf.bytes_per_block_per_device


def _view(arena: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A [pages, *shape] `dtype` view of bytes [offset, offset + prod(shape) * itemsize) of each arena row."""
    nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    rows = arena[:, offset : offset + nbytes]  # [pages, nbytes] (row stride = arena row)
    return rows.view(dtype).view(arena.shape[0], *shape)  # splits the contiguous last dim only


@dataclass(eq=False)
class HybridKVCacheBuffer(MultiKVCacheBuffer):
    """One replica's group buffers, all aliasing `arenas` (one per TP shard); state groups alias
    `state_arenas` (``uint8 [state rows + 1, state row bytes]`` per shard; none without state groups)."""

    arenas: list[torch.Tensor] = field(default_factory=list)
    state_arenas: list[torch.Tensor] = field(default_factory=list)

    def to_memory(self) -> list[KVCacheMemory]:
        """One unit per shard: the arena rows (a page id's bytes, whichever group owns it)."""
        return [KVCacheMemory(buffer=a) for a in self.arenas]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ROW_ALIGN) * ROW_ALIGN


def allocate_arena_buffers(
    names: Sequence[str], leaves: Sequence[KVCacheParams], total_num_pages: int, state_rows: int = 0
) -> list[HybridKVCacheBuffer]:
    """Zeroed arenas and per-leaf views, one `HybridKVCacheBuffer` (children named `names`) per replica:
    `total_num_pages` attention rows (null page included) and `state_rows` state rows (null row included)."""
    first = leaves[0]
    row = _aligned(max((leaf_page_bytes(leaf) for leaf in leaves if not isinstance(leaf, StateCacheParams)),
                       default=0))  # fmt: skip
    offsets, state_row = {}, 0
    for name, leaf in zip(names, leaves, strict=True):
        if isinstance(leaf, StateCacheParams):
            offsets[name], state_row = state_row, state_row + _aligned(leaf_page_bytes(leaf))
    out = []
    for r, devices in enumerate(first.devices_per_replica):
        arenas = [torch.zeros((total_num_pages, row), dtype=torch.uint8, device=d.to_torch()) for d in devices]
        states = [torch.zeros((state_rows, state_row), dtype=torch.uint8, device=d.to_torch())
                  for d in devices] if offsets else []  # fmt: skip
        children: dict[str, KVCacheBuffer | MultiKVCacheBuffer] = {}
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, StateCacheParams):
                children[name] = make_state_buffer(leaf, [a[:, offsets[name] :] for a in states])
                continue
            values = [_view(a, 0, leaf.shape_per_block, leaf.dtype.to_torch()) for a in arenas]
            scales = None
            if leaf.quantized_kv_cache:
                assert leaf.kvcache_quant_config is not None
                offset = math.prod(leaf.shape_per_block) * leaf.dtype.size_in_bytes
                scale_dtype = leaf.kvcache_quant_config.scale_dtype.to_torch()
                scales = [_view(a, offset, leaf.shape_per_scale_block, scale_dtype) for a in arenas]
            children[name] = KVCacheBuffer(leaf.replicates_kv_across_tp, values, scales)
        out.append(HybridKVCacheBuffer(children, arenas, states))
        del r
    return out
