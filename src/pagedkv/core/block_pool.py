"""The page pool: reference counts, the prefix cache and the eviction order.

Every page id in ``[0, num_blocks)`` is in exactly one state::

    in use     ref > 0                    held by one or more requests
    cached     ref == 0, hash set         evictable, in a free list, still hittable
    fresh      ref == 0, no hash          on the fresh stack, holds nothing reusable

Page ``num_blocks`` is the null page: never handed out, never counted.

Allocation takes fresh pages first (most recently freed first, so a fresh
pool hands out 0, 1, 2, ...), then evicts cached pages. A cached page is
never evicted while a fresh one exists. Cached free pages sit in one of
three lists, evicted in this order, each oldest first:

    probation  (SLRU only) cached pages never reused since they were cached
    LRU        the others
    protected  pinned pages: a running request still needs them kept

Callers free a request's pages tail first, so the deepest pages of a prefix
are evicted before its head.

A *pin* marks a cached page that a running request no longer reads (it fell
out of the request's attention window) but whose loss would break that
request's prefix for later hits: the full-attention pages of the prefix stay
held, so the window pages must stay too. A free pinned page is protected:
evicted only after every unpinned one. Pins are counted; `unpin` at request
end returns the page to the LRU. Each caching of a page gets a new stamp, so
an owner's pin on a page evicted and re-cached since is recognised as stale.

Storage is struct-of-arrays (about 40 bytes per page before any caching):
int32 ref counts, pins and stamps, int32 prev/next links of the free lists,
an int32 fresh stack, one slot per page for its hash, one byte each for the
group that cached it, its list and its reuse bit. Building a pool of a
million pages takes milliseconds.

Hybrid models (several KV cache groups, e.g. sliding-window and full layers)
share one pool: a page id belongs to one group at a time, and each group has
its own prefix cache (the same prefix hash maps to a different page in each).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from pagedkv.core.arc import ArcState
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.evictor import HeapOrder
from pagedkv.core.free_lists import LRU, NONE, PROBATION, PROTECTED, FreeLists
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool_checks import check_pool
from pagedkv.core.pool_queries import PoolQueries
from pagedkv.core.pool_retention import PoolRetention
from pagedkv.validation import INT32_MAX, check_eviction, check_int

__all__ = ["BlockPool"]


class BlockPool(PoolQueries, PoolRetention):
    """Page ids, ref counts, pins and the hash -> page prefix caches of one replica.

    `eviction_policy`: "lru"; "slru" (segmented LRU: cached pages never reused since they were
    cached are evicted before pages that served a hit, each segment in LRU order); or "lfu" (LFU with
    dynamic aging, see `evictor`). `leaves_first`: never evict a page while its chain child is cached.
    `protected_fraction`: at most this share of the pages sits in the protected list; a pinned page
    freed while it is full goes to the LRU like any other. Plain "lru"/"slru" evict from list heads;
    "lfu", `leaves_first` and retention priorities (`set_priority`) use a keyed `HeapOrder`.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        num_groups: int = 1,
        eviction_policy: str = "lru",
        protected_fraction: float = 0.25,
        leaves_first: bool = False,
    ) -> None:
        check_int("num_blocks", num_blocks, 1, INT32_MAX - 1)  # page ids and the null page id are int32
        check_int("num_groups", num_groups, 1)
        check_eviction(eviction_policy, protected_fraction, leaves_first)
        self.eviction_policy = eviction_policy
        self._slru = eviction_policy in ("slru", "arc")  # (ARC keeps SLRU's two lists, see `arc`)
        self.arc = ArcState(num_blocks) if eviction_policy == "arc" else None
        n = num_blocks
        self.num_blocks = n
        self.null_block = n
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = array("i", [0]) * n
        self._pins = array("i", [0]) * n
        self._stamp = array("q", [0]) * n  # which caching of the page a pin refers to
        self._next_stamp = 1  # stamps start at 1: 0 marks an uncached page
        self._hash: list[BlockHash | None] = [None] * n
        self._group = bytearray(n)  # the group whose prefix cache holds the page's hash
        self._reused = bytearray(n)  # 1 once a cached page was hit or merged into (SLRU's "frequent")
        self._caches: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._cache = self._caches[0]
        self._fresh = array("i")
        self._fresh.frombytes(np.arange(n - 1, -1, -1, dtype=np.int32).tobytes())
        self._lists = FreeLists(n)
        self.protected_fraction = protected_fraction
        self.max_protected = int(n * protected_fraction)  # cap on the protected list
        self.num_evictions = 0
        self.on_removed: Callable[[BlockHash, int], None] | None = None  # (hash, group) of each page forgotten
        self.on_uncached: list[Callable[[int], None]] = []  # called with each page that loses its hash
        self.leaves_first = leaves_first
        self._order: HeapOrder | None = None
        if eviction_policy == "lfu" or leaves_first:
            self._keyed()

    # ------------------------------------------------------------------ mutations
    def touch(self, pages: Iterable[int]) -> None:
        """Add a reference to each of `pages` (a prefix hit or merge: cached pages leave their free list)."""
        ref, reused, lists, order = self._ref, self._reused, self._lists, self._order
        for page in pages:
            if ref[page] == 0:
                lists.unlink(page)
            ref[page] += 1
            reused[page] = 1
            if order is not None:
                order.hit(page)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages with ref 1: fresh ones first, then evict (probation, then LRU).

        Protected pages are never taken here (see `take`). Evicted pages lose
        their hash and their pins. Raises `InsufficientBlocksError` (and takes
        nothing) when there are fewer than `n` such pages.
        """
        free = self.num_free - self.num_protected
        if n > free:
            raise InsufficientBlocksError(
                f"Cannot get {n} free blocks (only {free} available)", needed=n, available=free
            )
        fresh, ref = self._fresh, self._ref
        k = min(n, len(fresh))
        pages = fresh[len(fresh) - k :].tolist()
        pages.reverse()
        del fresh[len(fresh) - k :]
        if k < n:
            pages.extend(self._evict(n - k))
        for page in pages:
            ref[page] = 1
        return pages

    def take(self, pages: list[int]) -> list[int]:
        """Evict these free cached pages (the caller's own protected ones) and hand them out with ref 1."""
        for page in pages:
            if self._lists.where[page] == NONE or self._ref[page]:
                raise ValueError(f"page {page} is not free and cached")
        for page in pages:
            self._lists.unlink(page)
            self._uncache(page)
            self._ref[page] = 1
        self.num_evictions += len(pages)
        return list(pages)

    def _evict(self, n: int) -> list[int]:
        lists, count = self._lists, self._lists.count
        pages = []
        order, arc = self._order, self.arc
        for _ in range(n):
            if order is not None:
                page = order.victim()
            elif arc is not None:
                t1 = arc.from_probation(count[PROBATION], count[LRU])
                page = lists.head(PROBATION if t1 else LRU)
                arc.evicted(self._hash[page], t1)  # type: ignore[arg-type]
            else:
                page = lists.head(PROBATION if count[PROBATION] else LRU)
            lists.unlink(page)
            self._uncache(page)
            pages.append(page)
        self.num_evictions += n
        return pages

    def forget(self, page: int) -> None:
        """Drop the hash of held `page` without a removal event: it was committed before its KV was
        written (`commit_on_alloc`) and the write never happened, so no listener ever heard of it."""
        if self._ref[page] < 1 or self._hash[page] is None:
            raise ValueError(f"page {page} is not held and cached")
        self._uncache(page, announce=False)

    def _uncache(self, page: int, announce: bool = True) -> None:
        for hook in self.on_uncached:
            hook(page)
        if self._order is not None:
            self._order.forget(page)
        if announce and self.on_removed is not None:
            self.on_removed(self._hash[page], self._group[page])  # type: ignore[arg-type]
        del self._caches[self._group[page]][self._hash[page]]  # type: ignore[arg-type]
        self._hash[page] = None
        self._reused[page] = 0
        self._pins[page] = 0
        self._stamp[page] = 0  # pins taken on this caching are stale from now on

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page, in order; pages reaching 0 become free.

        Cached pages go to a list tail, still hittable: protected when pinned,
        else probation (SLRU, until first reused) or LRU; others to the fresh
        stack. The null page is ignored.
        """
        ref, hashes, fresh, null, order = self._ref, self._hash, self._fresh, self.null_block, self._order
        pins, append = self._pins, self._lists.append
        plain = LRU if not self._slru else 0  # the list of an unpinned page, when it does not depend on reuse
        for page in pages:
            if page == null:
                continue
            count = ref[page] - 1
            ref[page] = count
            if count:
                continue
            if hashes[page] is None:
                fresh.append(page)
                continue
            which = plain if plain and not pins[page] else self._list_for(page)
            append(page, which)
            if order is not None and which != PROTECTED:
                order.listed(page)

    def pin(self, pages: Iterable[int], reused: bool = False) -> list[tuple[int, int]]:
        """Pin cached `pages`; returns the (page, stamp) pairs to unpin with. Free ones become
        protected while the list has room. `reused` marks them as having served a hit (SLRU)."""
        pins, lists, reuse = self._pins, self._lists, self._reused
        out = []
        for page in pages:
            if self._hash[page] is None:
                raise ValueError(f"page {page} is not cached: only cached pages can be pinned")
            pins[page] += 1
            if reused:
                reuse[page] = 1
            if lists.where[page] not in (NONE, PROTECTED) and lists.count[PROTECTED] < self.max_protected:
                lists.move(page, PROTECTED)  # (when the list is full it stays where it is)
            out.append((page, self._stamp[page]))
        return out

    def unpin(self, pinned: Iterable[tuple[int, int]]) -> None:
        """Drop the pins `pin` returned; stale ones (page evicted since) are ignored. A free page
        left with no pin moves from the protected list to the tail of its cached list."""
        pins, lists, stamps = self._pins, self._lists, self._stamp
        for page, stamp in pinned:
            if stamps[page] != stamp or not pins[page]:
                continue
            pins[page] -= 1
            if not pins[page] and lists.where[page] == PROTECTED:
                self._relist(page)

    def release(self, pages: Iterable[int], held: Iterable[bool]) -> None:
        """In one pass over `pages`: drop a reference from each held page (as `free`), and move each
        page that is not held but sits free and cached to the tail of its list (a recency refresh)."""
        where = self._lists.where
        for page, is_held in zip(pages, held, strict=True):
            if is_held:
                self.free((page,))
            elif where[page] != NONE:
                self._relist(page)

    def _relist(self, page: int) -> None:
        """Move free cached `page` to the tail of the list it belongs in now."""
        which = self._list_for(page)
        self._lists.move(page, which)
        if self._order is not None and which != PROTECTED:
            self._order.listed(page)

    def _list_for(self, page: int) -> int:
        if self._pins[page] and self._lists.count[PROTECTED] < self.max_protected:
            return PROTECTED
        return PROBATION if self._slru and not self._reused[page] else LRU

    def commit(self, page: int, block_hash: BlockHash, group: int = 0, parent: int = -1) -> int:
        """Cache the full, written `page` under `block_hash` in `group`; returns the page to use.

        `parent` is the page holding the previous page of the chain (-1 for a chain's first page).
        If another page already holds `block_hash` there, that page gains the
        caller's reference and `page` is freed (the caller must swap it in).
        """
        cache = self._caches[group]
        existing = cache.get(block_hash)
        if existing is None:
            cache[block_hash] = page
            self._hash[page] = block_hash
            self._group[page] = group
            self._stamp[page] = self._next_stamp
            self._next_stamp += 1
            if self._order is not None:
                linked = parent >= 0 and self._hash[parent] is not None
                self._order.cached(page, parent if linked else -1, self._stamp[parent] if linked else 0)
            return page
        if existing != page:
            self.touch((existing,))
            self.free((page,))
        return existing

    def commit_run(self, pages: list[int], keys: list[BlockHash], parent: int, stop_at_cached: bool) -> list[int]:
        """`commit` pages[k] under keys[k] in group 0, each chained to the one before (`parent` first);
        returns the pages to use. `stop_at_cached`: stop before the first key another page holds."""
        cache, hashes, group, stamp, order = self._caches[0], self._hash, self._group, self._stamp, self._order
        out: list[int] = []
        for page, key in zip(pages, keys, strict=True):
            if order is None and key not in cache:  # (inlined `commit`: this runs once per page)
                cache[key] = page
                hashes[page] = key
                group[page] = 0
                stamp[page] = self._next_stamp
                self._next_stamp += 1
            elif stop_at_cached and cache.get(key, page) != page:
                break
            else:
                page = self.commit(page, key, 0, parent)
            out.append(page)
            parent = page
        return out

    def reset_prefix_cache(self) -> int:
        """Forget every evictable unpinned cached page (they become fresh); returns how many.

        Pages in use or pinned keep their hashes, so running requests still commit and hit.
        """
        pages = [*self.list_pages(LRU), *self.list_pages(PROBATION)]
        for page in pages:
            self._lists.unlink(page)
            self._uncache(page)
        self._fresh.extend(reversed(pages))
        return len(pages)

    def check_integrity(self, holders: Mapping[int, int], pins: Mapping[int, int] | None = None) -> None:
        """Raise `IntegrityError` unless every page is in exactly one state (see `pool_checks`).

        Args:
            holders: page -> number of references the request tables hold.
            pins: page -> live pins the requests hold (None: no pins expected).
        """
        check_pool(self, holders, pins or {})
