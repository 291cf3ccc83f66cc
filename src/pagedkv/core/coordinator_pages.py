"""Where a hybrid alloc's pages come from: the capacity bound, the owner's protected pages, and the
decode fast path of `KVCacheCoordinator` (a mixin: the methods read the coordinator's fields)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.core.errors import require as _require
from pagedkv.core.hybrid_state import HybridRequest, Plan
from pagedkv.core.tables import required_pages

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.block_pool import BlockPool
    from pagedkv.core.managers import GroupManager

__all__ = ["PageSource"]


class PageSource:
    """Page supply of a coordinator; see `KVCacheCoordinator` for the pin and protection rules."""

    pool: BlockPool
    page_size: int
    num_speculative_tokens: int
    _reqs: dict[Any, Any]  # request id -> HybridRequest
    _decoder_ids: list[int]
    _windowed: list[GroupManager]
    _input_tokens: int

    def _freed_by(self, st: HybridRequest, plan: Plan) -> int:
        """Pages the plan's drops free for this request to take: uncached ones (fresh stack), and
        cached ones nobody else pins when it may recycle its own protected pages (`_alone`)."""
        pool, null, own_ok = self.pool, self.pool.null_block, self._alone(st)
        count = 0
        for g, (lo, hi) in enumerate(plan.drops):
            pages = st.tables[g].pages
            for i in range(lo, min(hi, st.tables[g].num_pages)):
                page = int(pages[i])
                if page != null and pool.ref_count(page) == 1:
                    count += pool.block_hash(page) is None or (own_ok and pool.pin_count(page) == 0)
        return count

    def _available(self, st: HybridRequest, plan: Plan) -> int:
        """A lower bound on what `_take` finds once the plan's hits, pins and drops are applied:
        free unprotected pages, minus the free hits it takes out and the free pages its pins may
        move to the protected list, plus `_freed_by` and its own protected pages (`_own`)."""
        pool, null, own_ok = self.pool, self.pool.null_block, self._alone(st)
        hits = {p for pages in plan.hit_pages for p in pages if p != null}
        lost = sum(1 for p in hits if pool.ref_count(p) == 0 and not pool.is_protected(p))
        lost += sum(
            1
            for p in plan.pins  # a page only st pins stays takeable when own_ok
            if pool.ref_count(p) == 0 and not pool.is_protected(p) and not (own_ok and pool.pin_count(p) == 0)
        )
        return pool.num_free - pool.num_protected - lost + self._freed_by(st, plan) + len(self._own(st))

    def _alone(self, st: HybridRequest) -> bool:
        """True when no other request holds pages: only then does `st` recycle its own protected
        pages (otherwise the caller preempts, which keeps every cached prefix whole)."""
        return not any(o is not st and o.num_pages for o in self._reqs.values())

    def _own(self, st: HybridRequest) -> list[int]:
        """Free protected pages only `st` pins, deepest first, when `_alone`; else none."""
        pool = self.pool
        if not st.pinned or not self._alone(st):
            return []
        return [
            p for p, s in reversed(st.pinned) if pool.stamp(p) == s and pool.is_protected(p) and pool.pin_count(p) == 1
        ]

    def _take(self, st: HybridRequest, n: int) -> list[int]:
        """`n` pages: fresh, probation and LRU ones first, then `st`'s own protected ones."""
        pool = self.pool
        k = min(n, pool.num_free - pool.num_protected)
        pages = pool.allocate(k) if k else []
        if k < n:
            pages.extend(pool.take(self._own(st)[: n - k]))
            st.pinned = [(p, s) for p, s in st.pinned if pool.stamp(p) == s]
        _require(len(pages) == n, f"took {len(pages)} of {n} pages the capacity check promised")
        return pages

    def _decode_step(self, st: HybridRequest, length: int, processed: int) -> bool:
        """One decode token of a running request, done directly: drop what the window groups no
        longer read, then open the page each decoder group lacks. The same result as the general
        path; False (nothing done) when that path must decide: first alloc, a stale context, a
        dummy, or too few unprotected free pages."""
        pool, ps = self.pool, self.page_size
        if st.dummy or not st.ready or processed > st.ready:
            return False
        need = required_pages(length + self.num_speculative_tokens, ps)
        tables = st.tables
        short = [t for t in [tables[g] for g in self._decoder_ids] if t.num_pages < need]
        total = need * len(short) - sum([t.num_pages for t in short])
        if total > pool.num_free - pool.num_protected:  # drops only add free pages: this is enough
            return False
        if processed >= st.next_drop:
            self._drop(st, processed)
            st.next_drop = min([g.drop_threshold(st.dropped[g.group]) for g in self._windowed])
        if total:
            pages = pool.allocate(total)
            if total == len(short):  # one page each (no draft slots): item stores
                for table, page in zip(short, pages, strict=True):
                    table.push(page)
            else:
                i = 0
                for table in short:
                    table.append(pages[i : i + need - table.num_pages])
                    i += need - table.num_pages
            st.ready = need * ps  # every decoder table now holds `need` pages or more
        self._input_tokens += 1
        return True

    def _drop(self, st: HybridRequest, processed: int) -> None:
        """Return the pages no query from `processed` on reads (as `_plan_alloc` + `_apply` do)."""
        null, freed = self.pool.null_block, list[int]()
        for gm in self._windowed:
            g, table = gm.group, st.tables[gm.group]
            keep = max(st.dropped[g], st.shared)
            hi = max(keep, min(gm.droppable_pages(processed), table.num_pages))
            end = min(hi, table.num_pages)
            freed.extend(p for p in table.pages[keep:end].tolist() if p != null)
            table.pages[keep:end] = null
            st.dropped[g] = hi
        cached = self.pool.block_hash
        st.pinned.extend(self.pool.pin(p for p in freed if cached(p) is not None))
        self.pool.free(reversed(freed))
