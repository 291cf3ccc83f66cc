"""`PageSupply`: where a `KVCacheCoordinator`'s allocations find pages (pure Python + numpy).

Free unprotected pages first; then, when no other request holds pages, the request's own protected
pages (free cached pages it pinned out of a window). Otherwise the caller preempts, which keeps every
cached prefix whole. `available` is the capacity check `take` keeps.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.core.context import RequestID
from pagedkv.core.errors import require as _require
from pagedkv.core.hybrid_state import HybridRequest, Plan
from pagedkv.core.pool import BlockPool

__all__ = ["PageSupply"]


class PageSupply:
    """The page supply of one coordinator's pool, over its requests (read only)."""

    def __init__(self, pool: BlockPool, reqs: Mapping[RequestID, HybridRequest]) -> None:
        self.pool = pool
        self._reqs = reqs

    def freed_by(self, st: HybridRequest, plan: Plan) -> int:
        """Pages the plan's drops free for this request to take: uncached ones (fresh stack), and
        cached ones nobody else pins when it may recycle its own protected pages (`alone`)."""
        pool, null, own_ok = self.pool, self.pool.null_block, self.alone(st)
        count = 0
        for g, (lo, hi) in enumerate(plan.drops):
            pages = st.tables[g].pages
            for i in range(lo, min(hi, st.tables[g].num_pages)):
                page = int(pages[i])
                if page != null and pool.ref_count(page) == 1:
                    count += pool.block_hash(page) is None or (own_ok and pool.pin_count(page) == 0)
        return count

    def available(self, st: HybridRequest, plan: Plan) -> int:
        """A lower bound on what `take` finds once the plan's hits, pins and drops are applied:
        free unprotected pages, minus the free hits it takes out and the free pages its pins may
        move to the protected list, plus `freed_by` and its own protected pages (`own`)."""
        pool, null, own_ok = self.pool, self.pool.null_block, self.alone(st)
        hits = {p for pages in plan.hit_pages for p in pages if p != null}
        hits.update(plan.checkpoint.run if plan.checkpoint is not None else ())  # (a run the restore holds)
        lost = sum(1 for p in hits if pool.ref_count(p) == 0 and not pool.is_protected(p))
        lost += sum(
            1
            for p in plan.pins  # a page only st pins stays takeable when own_ok
            if pool.ref_count(p) == 0 and not pool.is_protected(p) and not (own_ok and pool.pin_count(p) == 0)
        )
        return pool.num_free - pool.num_protected - lost + self.freed_by(st, plan) + len(self.own(st))

    def alone(self, st: HybridRequest) -> bool:
        """True when no other request holds pages: only then does `st` recycle its own protected
        pages (otherwise the caller preempts, which keeps every cached prefix whole)."""
        return not any(o is not st and o.num_pages for o in self._reqs.values())

    def own(self, st: HybridRequest) -> list[int]:
        """Free protected pages only `st` pins, deepest first, when `alone`; else none."""
        pool = self.pool
        if not st.pinned or not self.alone(st):
            return []
        return [
            p for p, s in reversed(st.pinned) if pool.stamp(p) == s and pool.is_protected(p) and pool.pin_count(p) == 1
        ]

    def take(self, st: HybridRequest, n: int) -> list[int]:
        """`n` pages: fresh, probation and LRU ones first, then `st`'s own protected ones."""
        pool = self.pool
        k = min(n, pool.num_free - pool.num_protected)
        pages = pool.allocate(k) if k else []
        if k < n:
            pages.extend(pool.take(self.own(st)[: n - k]))
            st.pinned = [(p, s) for p, s in st.pinned if pool.stamp(p) == s]
        _require(len(pages) == n, f"took {len(pages)} of {n} pages the capacity check promised")
        return pages
