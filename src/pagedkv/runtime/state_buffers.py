"""Buffers of a state group: per TP shard, uint8 pages viewed as each layer's state tensors.

`values[s]` is the group's ``uint8 [pages, num_layers, layer_bytes]`` page
tensor on shard s (its own allocation, or the first bytes of each arena row of
a hybrid model), and ``states[s][layer][i]`` views state tensor i of that
layer over every page: ``[pages, *state_spec.shard(tp)[i]]`` in its dtype,
sharing the page bytes. A request's state slot p is ``states[s][layer][i][p]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedkv.params.state import StateCacheParams
from pagedkv.runtime.buffers import KVCacheBuffer, check_fits

__all__ = ["StateCacheBuffer", "allocate_state_buffers", "state_views"]


def state_views(leaf: StateCacheParams, rows: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per layer of `leaf`, its state tensors viewed over `rows` (``uint8 [pages, >= page bytes]``, the
    group's bytes first in each row; row stride and start 16-byte aligned)."""
    pages, layer_bytes = rows.shape[0], leaf.layer_bytes_per_device
    out = []
    for layer in range(leaf.num_layers):
        views = []
        for offset, shape, dtype in leaf.state_layout():
            start = layer * layer_bytes + offset
            nbytes = math.prod(shape) * dtype.size_in_bytes
            flat = rows[:, start : start + nbytes].view(dtype.to_torch())  # [pages, n] (row stride kept)
            views.append(flat.view(pages, *shape))  # [pages, *shape]
        out.append(tuple(views))
    return out


@dataclass(eq=False)
class StateCacheBuffer(KVCacheBuffer):
    """A state group's pages on one replica: `values[s]` uint8 ``[pages, num_layers, layer_bytes]`` and
    ``states[s][layer]`` the layer's state tensors (see the module docstring)."""

    states: list[list[tuple[torch.Tensor, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.values = list(self.values)
        if not self.values or any(v.dtype != torch.uint8 or v.dim() != 3 for v in self.values):
            raise ValueError("a state buffer's values are uint8 [pages, num_layers, layer_bytes], one per TP shard")
        if len(self.states) != len(self.values):
            raise ValueError(f"states has {len(self.states)} shards but values has {len(self.values)}")

    @property
    def page_size(self) -> int:
        """A state page holds one state, not tokens: refused (read the params' `page_size`)."""
        raise ValueError("a state group's pages hold one state each; their page size is the params' page_size")


def make_state_buffer(leaf: StateCacheParams, rows: list[torch.Tensor]) -> StateCacheBuffer:
    """The buffer of `leaf` over one ``uint8 [pages, >= page bytes]`` row tensor per TP shard."""
    pages, nbytes = rows[0].shape[0], leaf.bytes_per_block_per_device
    values = [r[:, :nbytes].view(pages, leaf.num_layers, leaf.layer_bytes_per_device) for r in rows]
    return StateCacheBuffer(leaf.replicates_kv_across_tp, values, None, [state_views(leaf, r) for r in rows])


def allocate_state_buffers(params: StateCacheParams, total_num_pages: int) -> list[StateCacheBuffer]:
    """Zeroed state pages on every device, one `StateCacheBuffer` per replica."""
    check_fits(params, total_num_pages)
    row = params.bytes_per_block_per_device
    return [
        make_state_buffer(
            params, [torch.zeros((total_num_pages, row), dtype=torch.uint8, device=d.to_torch()) for d in devices]
        )
        for devices in params.devices_per_replica
    ]
