"""`PoolRetention`: retention priorities of a `BlockPool`'s cached pages (TensorRT-LLM's, with expiry)
and the lazily built keyed eviction order (`evictor.HeapOrder`) they need."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from pagedkv.core.evictor import MAX_PRIORITY, HeapOrder
from pagedkv.core.free_lists import LRU, PROBATION, FreeLists
from pagedkv.core.hashing import BlockHash
from pagedkv.validation import check_int

__all__ = ["PoolRetention"]


class PoolRetention:
    """Mixed into `BlockPool`, which owns the state used here."""

    num_blocks: int
    eviction_policy: str
    leaves_first: bool
    _order: HeapOrder | None
    _lists: FreeLists
    _reused: bytearray
    _stamp: array
    _hash: list[BlockHash | None]

    def set_priority(self, pages: Iterable[int], priority: int, duration_s: float | None = None) -> None:
        """Set the retention priority of cached `pages` (0..100, default 35; lower is evicted first) for
        `duration_s` seconds of the pool clock (`_order.clock`; None: for as long as they stay cached)."""
        check_int("priority", priority, 0)
        if priority > MAX_PRIORITY:
            raise ValueError(f"priority={priority} must be at most {MAX_PRIORITY}")
        pages = list(pages)
        for page in pages:
            if self._hash[page] is None:
                raise ValueError(f"page {page} is not cached: only cached pages take a retention priority")
        order = self._keyed()
        expires = None if duration_s is None else order.clock() + duration_s
        for page in pages:
            order.set_priority(page, priority, expires)

    def retain(self, pages: Iterable[int], priority: int, duration_s: float | None) -> None:
        """Raise the retention priority of cached `pages` to `priority` for `duration_s` seconds from
        now (None: while cached); pages already at a higher priority keep theirs."""
        order = self._keyed()
        expires = None if duration_s is None else order.clock() + duration_s
        current = order.priority
        for page in pages:
            if self._hash[page] is not None and current[page] <= priority:
                order.set_priority(page, priority, expires)

    def _keyed(self) -> HeapOrder:
        """The keyed eviction order, built on first use from the lists' current order."""
        if self._order is None:
            order = HeapOrder(self.num_blocks, self._lists, self._reused, self._stamp, self.eviction_policy,
                              self.leaves_first)  # fmt: skip
            for page in [*self._lists.pages(PROBATION), *self._lists.pages(LRU)]:
                order.listed(page)
            self._order = order
        return self._order
