"""`SwapAccess`: swap preemption on `PagedKVCacheManager`, when a host tier exists.

    if mgr.swap_out(rid):        # pages copied to host rows, device pages released
        ...                      # (the context is left as is: do not reset it)
    mgr.swap_in(ctx)             # pages back (device-cached prefix pages reused), exact bytes
    mgr.alloc(ctx)               # then the next window as usual

A swapped-out request is not claimed on the device; `release` of it gives
its host rows back.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core import swap
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import RequestID, TextContext
from pagedkv.manager.tiering import Tiering

__all__ = ["SwapAccess"]


class SwapAccess:
    """Swap out / swap in of whole requests through each replica's host tier."""

    tiers: Tiering
    enable_runtime_checks: bool
    _swapped: dict[tuple[int, RequestID], tuple[swap.SwappedPages, list[int]]]

    def _bm(self, replica_idx: int) -> BlockManager:  # pragma: no cover - PagedKVCacheManager's
        raise NotImplementedError

    def _checked(self, bm: BlockManager) -> None:  # pragma: no cover - PagedKVCacheManager's
        raise NotImplementedError

    def _swap_space(self, replica_idx: int) -> Any:
        spaces = self.tiers.swap_spaces
        return spaces[replica_idx] if spaces else None

    @property
    def can_swap(self) -> bool:
        """True when a host tier exists (swap preemption is possible at all)."""
        return bool(self.tiers.swap_spaces)

    def is_swapped(self, request_id: RequestID, replica_idx: int = 0) -> bool:
        """True while `request_id` is swapped out."""
        return (replica_idx, request_id) in self._swapped

    def swapped_pages(self, request_id: RequestID, replica_idx: int = 0) -> int:
        """Pages parked in host rows for `request_id` (0 when it is not swapped out)."""
        entry = self._swapped.get((replica_idx, request_id))
        return entry[0].num_pages if entry else 0

    def swap_out(self, request_id: RequestID, replica_idx: int = 0) -> bool:
        """Copy every page of the claimed `request_id` to host rows and release its device pages.

        Returns False, changing nothing, without a host tier or when the host
        tier cannot lend enough rows (the caller then preempts by recompute).
        The request's context must not be reset; resume it with `swap_in`.
        """
        bm = self._bm(replica_idx)
        space = self._swap_space(replica_idx)
        pages, record = swap.snapshot(bm, request_id)  # validates: claimed, not a dummy
        if space is None:
            return False
        slots = space.swap_out(pages)  # None when the host tier cannot lend that many rows
        if slots is None:
            return False
        bm.release(request_id)
        self._swapped[(replica_idx, request_id)] = (record, slots)
        self._checked(bm)
        return True

    def swap_in(self, ctx: TextContext, replica_idx: int = 0) -> None:
        """Claim ``ctx.request_id`` again with its swapped pages, bit for bit; the host rows return to
        the tier. Raises `InsufficientBlocksError` (too few device pages) or `ValueError` (not
        swapped out) and then changes nothing."""
        bm = self._bm(replica_idx)
        if not isinstance(ctx, TextContext):
            raise TypeError(f"ctx must be a TextContext, got {type(ctx).__name__}")
        entry = self._swapped.get((replica_idx, ctx.request_id))
        if entry is None:
            raise ValueError(f"request {ctx.request_id!r} is not swapped out on replica {replica_idx}")
        space = self._swap_space(replica_idx)
        if space is None:
            raise ValueError(f"request {ctx.request_id!r} cannot swap in: the tiers are closed")
        record, slots = entry
        todo = swap.restore(bm, ctx, record)
        del self._swapped[(replica_idx, ctx.request_id)]
        copied = {i for i, _ in todo}
        space.swap_in([slots[i] for i, _ in todo], [page for _, page in todo])
        space.drop([slot for i, slot in enumerate(slots) if i not in copied])  # device-cached pages
        swap.recommit(bm, ctx, record)
        self._checked(bm)

    def _drop_swapped(self, request_id: RequestID, replica_idx: int) -> bool:
        """Give back the host rows of a swapped-out request being released; False if not swapped."""
        entry = self._swapped.pop((replica_idx, request_id), None)
        if entry is None:
            return False
        space = self._swap_space(replica_idx)
        if space is not None:
            space.drop(entry[1])
        return True
