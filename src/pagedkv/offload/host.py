"""`HostTier`: pages in host memory (pinned when CUDA is present), LRU over a fixed number of rows.

Rows hold pages in `PageMover`'s row format. The tier lives in this
process only, so rows carry no header: the formats that leave the process
(disk files, Redis values) do (`offload.format`).
"""

from __future__ import annotations

import torch

from pagedkv.offload.tier_index import TierIndex
from pagedkv.offload.tier_stats import TierStats
from pagedkv.params.validation import check_int

__all__ = ["HostTier"]


class HostTier:
    """`num_pages` rows of `row_bytes`, indexed by content hash (`index`)."""

    medium = "CPU"

    def __init__(self, num_pages: int, row_bytes: int, pin_memory: bool = False) -> None:
        check_int("num_pages", num_pages, 1)
        check_int("row_bytes", row_bytes, 1)
        self.buffer = torch.empty((num_pages, row_bytes), dtype=torch.uint8, pin_memory=pin_memory)  # [H, row]
        self.index = TierIndex(num_pages)
        self.stats = TierStats("host")
        self._rows = self.buffer.numpy()  # the same memory, for file and socket I/O

    @property
    def num_pages(self) -> int:
        """Rows in the tier."""
        return self.index.capacity

    @property
    def num_used_pages(self) -> int:
        """Rows holding a page."""
        return len(self.index)

    def row(self, slot: int) -> memoryview:
        """A writable bytes view of row `slot` (shares the tier's memory)."""
        return memoryview(self._rows[slot])
