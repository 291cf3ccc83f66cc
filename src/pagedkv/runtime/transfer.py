"""`to_device`: the one host-to-device copy of a step's tables (lookup table, cache lengths).

Every per-step table the managers hand to the model goes through here, so the
copy policy lives in one place. On CPU it is a plain copy (the caller may
reuse its host array). On CUDA the host tensor is pinned first and copied with
``non_blocking=True``: the copy is queued on the current stream and the host
does not wait for it. The pinned staging tensor is a fresh copy, so the caller
may reuse or free its source right away, and kernels queued later on the same
stream see the copied values (stream order), as PyTorch's "CUDA semantics"
notes on pinned memory describe.
"""

from __future__ import annotations

import torch

from pagedkv.core.tables import BatchTables
from pagedkv.runtime.inputs import max_lengths_table

__all__ = ["tables_to_device", "to_device"]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of the CPU tensor `host` on `device` (never a view of `host`); pinned + non-blocking on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)  # same shape as host
    return host.to(device, copy=True)  # same shape as host


def tables_to_device(tables: BatchTables, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A replica's step tables for one device: the lookup table and cache lengths copied there
    (`to_device`), and the ``max_lengths`` table, which stays on the CPU (it is read on the host)."""
    lut = to_device(torch.from_numpy(tables.lookup_table), device)  # [B, cols]
    lengths = to_device(torch.from_numpy(tables.cache_lengths), device)  # [B]
    return lut, lengths, max_lengths_table(tables.max_prompt_length, tables.max_cache_length)  # [1, 2]
