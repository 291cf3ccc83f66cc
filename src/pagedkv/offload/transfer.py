"""`PageMover`: whole pages between one replica's device buffers and rows of a host tensor.

A row is one page id of every offload unit (`KVCacheBuffer.to_memory()`:
each cache's values then scales, one unit per TP shard; a replicated MLA
cache is one unit, rank 0, copied back to every peer). Rows are the tiers'
native format: no reshape, the bytes as the kernels wrote them::

    row = [ unit 0 page (values, shard 0) | unit 1 page (values, shard 1) | ... | scales ... ]

On CUDA the copies run on a side stream per device (host rows pinned); on
CPU they are plain memcpys, which transfer threads run off the main thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagedkv.runtime.buffers import KVCacheBuffer, KVCacheMemory, MultiKVCacheBuffer, ReplicatedKVCacheMemory

__all__ = ["PageMover", "RowMover"]


class RowMover(Protocol):
    """What a `KVConnector` needs of its rows' source: pages (`PageMover`) or state checkpoints
    (`offload.state_images.StateImageMover`), addressed by an int id below `num_pages`."""

    row_bytes: int
    widths: list[int]
    cuda: bool

    @property
    def num_pages(self) -> int:
        """Ids `to_rows` / `from_rows` accept: [0, num_pages - 1) (the last one is the null id)."""

    def to_rows(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """``rows[slots[i]] = id block_ids[i]`` (device -> host)."""

    def from_rows(self, rows: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """``id block_ids[i] = rows[slots[i]]`` (host -> device)."""

    def sync(self) -> None:
        """Block until every copy issued so far is done."""


_LOOP_BYTES = 1 << 16  # pages at least this big are copied one by one (one pass); smaller ones gathered


class PageMover:
    """Copies pages of `buffer` to and from rows of host tensors ``uint8 [rows, row_bytes]``."""

    def __init__(self, buffer: KVCacheBuffer | MultiKVCacheBuffer) -> None:
        self.units: list[KVCacheMemory] = buffer.to_memory()
        widths = [u.bytes_per_page for u in self.units]
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.widths = widths
        self.row_bytes = sum(widths)
        self.cuda = any(u.buffer.device.type == "cuda" for u in self.units)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._keep: list[torch.Tensor] = []  # temporaries an async copy still reads

    @property
    def num_pages(self) -> int:
        """Device pages of every unit, the null page included."""
        return self.units[0].num_pages

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_rows(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """``rows[slots[i]] = page block_ids[i]`` for every i (device -> host)."""
        for unit, off, width in zip(self.units, self.offsets, self.widths, strict=True):
            src = unit.buffer  # [pages, width]
            if src.device.type == "cuda":
                self._to_rows_cuda(src, block_ids, rows, slots, off, width)
            elif width >= _LOOP_BYTES or len(self.units) > 1:
                for bid, slot in zip(block_ids, slots, strict=True):
                    rows[slot, off : off + width].copy_(src[bid])  # [width]
            else:
                index = torch.tensor(list(block_ids), dtype=torch.long)
                rows.index_copy_(0, torch.tensor(list(slots), dtype=torch.long), src.index_select(0, index))

    def from_rows(self, rows: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """``page block_ids[i] = rows[slots[i]]`` for every i (host -> device), peers of replicated units too."""
        index = torch.tensor(list(block_ids), dtype=torch.long)
        picked = torch.tensor(list(slots), dtype=torch.long)
        for unit, off, width in zip(self.units, self.offsets, self.widths, strict=True):
            targets = [unit.buffer, *(unit.peers if isinstance(unit, ReplicatedKVCacheMemory) else [])]
            source = rows[:, off : off + width]  # [rows, width] (strided when several units)
            for dst in targets:
                if dst.device.type == "cuda":
                    self._from_rows_cuda(dst, source, picked, index)
                elif width >= _LOOP_BYTES:
                    for slot, bid in zip(slots, block_ids, strict=True):
                        dst[bid].copy_(source[slot])  # [width]
                else:
                    dst.index_copy_(0, index, source.index_select(0, picked))

    def _to_rows_cuda(
        self,
        src: torch.Tensor,
        block_ids: Sequence[int],
        rows: torch.Tensor,
        slots: Sequence[int],
        off: int,
        width: int,
    ) -> None:  # pragma: no cover - needs a GPU
        stream = self._stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))  # the pages are written
        with torch.cuda.stream(stream):
            index = torch.tensor(list(block_ids), dtype=torch.long, device=src.device)
            gathered = src.index_select(0, index)  # [n, width] on the device
            for i, slot in enumerate(slots):
                rows[slot, off : off + width].copy_(gathered[i], non_blocking=True)
            self._keep.append(gathered)

    def _from_rows_cuda(
        self, dst: torch.Tensor, source: torch.Tensor, picked: torch.Tensor, index: torch.Tensor
    ) -> None:  # pragma: no cover - needs a GPU
        stream = self._stream(dst.device)
        stream.wait_stream(torch.cuda.current_stream(dst.device))  # work queued on the pages is done first
        with torch.cuda.stream(stream):
            staged = source.index_select(0, picked).pin_memory()  # [n, width] contiguous, pinned
            moved = staged.to(dst.device, non_blocking=True)
            dst.index_copy_(0, index.to(dst.device, non_blocking=True), moved)
            self._keep.extend((staged, moved))

    def sync(self) -> None:
        """Block until every copy issued so far is done, and order the main streams after them."""
        for device, stream in self._streams.items():  # pragma: no cover - needs a GPU
            stream.synchronize()
            torch.cuda.current_stream(device).wait_stream(stream)
        self._keep.clear()
