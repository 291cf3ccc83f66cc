"""`SwapSpace`: host rows lent to preempted requests, the tensor half of swap preemption.

A swapped-out request's device pages (all of them: committed, partial and
not yet written) are copied whole into rows taken out of the host tier's
index (`TierIndex.lend`): nothing evicts, clears or reuses them until the
request is swapped back in (or released), when the rows return to the tier.
The bytes come back exactly as the kernels wrote them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pagedkv.offload.connector import KVConnector

__all__ = ["SwapSpace"]


class SwapSpace:
    """Swap rows of one replica's host tier (`connector.host`, which must exist)."""

    def __init__(self, connector: KVConnector) -> None:
        if connector.host is None:
            raise ValueError("swap preemption needs a host tier (kv_connector local/tiered, or host pages)")
        self.connector = connector
        self.host = connector.host
        self.mover = connector.mover
        self.rows_lent = 0

    def rows_available(self) -> int:
        """Host rows `swap_out` may still take (free rows plus unpinned cached pages)."""
        return self.host.index.available()

    def swap_out(self, block_ids: Sequence[int]) -> list[int] | None:
        """Copy pages `block_ids` into lent host rows and return the rows (in order), or None (and
        no change) when the host tier cannot lend that many. Synchronous: the device pages may be
        reused when it returns. Evicts least recently used host pages (BlockRemoved events).
        Runs the connector's staged loads first: a page loaded at this step's `alloc` is read whole."""
        self.connector.complete_loads()  # (and waits for offloads: rows they write are pinned anyway)
        self.connector.wait_for_offloads()
        lent = self.host.index.lend(len(block_ids))
        if lent is None:
            return None
        slots, evicted = lent
        self.connector._evicted(evicted)
        start = time.perf_counter()
        self.mover.to_rows(list(block_ids), self.host.buffer, slots)
        self.mover.sync()
        self.rows_lent += len(slots)
        self.host.stats.add(pages_swapped_out=len(slots))
        self.host.stats.observe("store", time.perf_counter() - start)
        return slots

    def swap_in(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy rows `slots` into device pages `block_ids` (same length), then give the rows back.
        Runs the connector's staged loads first, so none of them lands later on a page swapped in now
        (a page loaded at `alloc`, released, evicted and handed to this request)."""
        if len(slots) != len(block_ids):
            raise ValueError(f"slots has {len(slots)} rows but block_ids has {len(block_ids)} pages")
        self.connector.complete_loads()
        start = time.perf_counter()
        if slots:
            self.mover.from_rows(self.host.buffer, list(slots), list(block_ids))
            self.mover.sync()
        self.host.stats.add(pages_swapped_in=len(slots))
        self.host.stats.observe("load", time.perf_counter() - start)
        self.drop(slots)

    def drop(self, slots: Sequence[int]) -> None:
        """Give rows back to the host tier without copying (the request is gone)."""
        self.host.index.give_back(slots)
        self.rows_lent -= len(slots)
