"""`SwappedRequests`: swap preemption for `PagedKVCacheManager`, when a host tier exists.

    if mgr.swap_out(rid):        # pages copied to host rows, device pages released
        ...                      # (the context is left as is: do not reset it)
    mgr.swap_in(ctx)             # pages back (device-cached prefix pages reused), exact bytes
    mgr.alloc(ctx)               # then the next window as usual

A swapped-out request is not claimed on the device; `release` of it gives
its host rows back. The bookkeeping half (which pages, which table to
rebuild) is `BlockManager.swap_snapshot` / `swap_restore` / `swap_recommit` (and the
`KVCacheCoordinator`'s of the same names for hybrid models, state slots included);
the bytes move through each replica's `SwapSpace` (host rows lent out of the
host tier).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.context import RequestID, TextContext
from pagedkv.core.hybrid_state import SwappedGroups
from pagedkv.core.replica import ReplicaBookkeeping
from pagedkv.core.tables import SwappedPages
from pagedkv.manager.tiering import Tiering

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.offload.swap_space import SwapSpace

__all__ = ["SwappedRequests"]


class SwappedRequests:
    """The swapped-out requests of every replica: their table records and the host rows holding them."""

    def __init__(self, tiers: Tiering) -> None:
        self.tiers = tiers
        self._entries: dict[tuple[int, RequestID], tuple[SwappedPages | SwappedGroups, list[int]]] = {}

    def __contains__(self, key: object) -> bool:
        """``(replica_idx, request_id) in swaps``: the request is swapped out on that replica."""
        return key in self._entries

    def keys(self) -> list[tuple[int, RequestID]]:
        """Every ``(replica_idx, request_id)`` swapped out."""
        return list(self._entries)

    def _space(self, replica_idx: int) -> SwapSpace | None:
        spaces = self.tiers.swap_spaces
        return spaces[replica_idx] if spaces else None

    @property
    def can_swap(self) -> bool:
        """True when a host tier exists (swap preemption is possible at all)."""
        return bool(self.tiers.swap_spaces)

    def num_pages(self, request_id: RequestID, replica_idx: int) -> int:
        """Pages parked in host rows for `request_id` (0 when it is not swapped out)."""
        entry = self._entries.get((replica_idx, request_id))
        return entry[0].num_pages if entry else 0

    def swap_out(self, bm: ReplicaBookkeeping, request_id: RequestID, replica_idx: int) -> bool:
        """Copy every page of the claimed `request_id` to host rows and release it from `bm`; False,
        changing nothing, without a host tier or when the tier cannot lend enough rows."""
        space = self._space(replica_idx)
        if space is None:
            bm.check_claimed(request_id)
            return False
        pages, record = bm.swap_snapshot(request_id)
        slots = space.swap_out(pages)  # None when the host tier cannot lend that many rows
        if slots is None:
            return False
        bm.release(request_id)
        self._entries[(replica_idx, request_id)] = (record, slots)
        return True

    def swap_in(self, bm: ReplicaBookkeeping, ctx: TextContext, replica_idx: int) -> None:
        """Claim ``ctx.request_id`` on `bm` again with its swapped pages, bit for bit; the host rows
        return to the tier. Raises `InsufficientBlocksError` (too few device pages) or `ValueError`
        (not swapped out, or the tiers are closed) and then changes nothing."""
        entry = self._entries.get((replica_idx, ctx.request_id))
        if entry is None:
            raise ValueError(f"request {ctx.request_id!r} is not swapped out on replica {replica_idx}")
        space = self._space(replica_idx)
        if space is None:
            raise ValueError(f"request {ctx.request_id!r} cannot swap in: the tiers are closed")
        record, slots = entry
        todo = bm.swap_restore(ctx, record)  # type: ignore[arg-type]  # (each replica restores its own record)
        del self._entries[(replica_idx, ctx.request_id)]
        copied = {i for i, _ in todo}
        space.swap_in([slots[i] for i, _ in todo], [page for _, page in todo])
        space.drop([slot for i, slot in enumerate(slots) if i not in copied])  # device-cached pages
        bm.swap_recommit(ctx, record)  # type: ignore[arg-type]

    def drop(self, request_id: RequestID, replica_idx: int) -> bool:
        """Give back the host rows of a swapped-out request being released; False if not swapped."""
        entry = self._entries.pop((replica_idx, request_id), None)
        if entry is None:
            return False
        space = self._space(replica_idx)
        if space is not None:
            space.drop(entry[1])
        return True
