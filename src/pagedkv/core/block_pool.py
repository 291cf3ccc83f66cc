"""The page pool: reference counts, the prefix cache and the eviction order.

Every page id in ``[0, num_blocks)`` is in exactly one state::

    in use     ref > 0                    held by one or more requests
    cached     ref == 0, hash set         evictable, in the LRU list, still hittable
    fresh      ref == 0, no hash          on the fresh stack, holds nothing reusable

Page ``num_blocks`` is the null page: never handed out, never counted.

Allocation takes fresh pages first (most recently freed first, so a fresh
pool hands out 0, 1, 2, ...), then evicts cached pages from the LRU head. A
cached page is never evicted while a fresh one exists. Freed cached pages
join the LRU tail; callers free a request's pages tail first, so the deepest
pages of a prefix are evicted before its head.

Storage is struct-of-arrays (25 bytes per page before any caching): int32
ref counts, int32 prev/next links of the LRU list (the sentinel is the null
page id), an int32 fresh stack, one slot per page for its hash and one byte
for the group that cached it. Building a pool of a million pages takes
milliseconds.

Hybrid models (several KV cache groups, e.g. sliding-window and full layers)
share one pool: a page id belongs to one group at a time, and each group has
its own prefix cache (the same prefix hash maps to a different page in each).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import BlockHash
from pagedkv.validation import check_int

__all__ = ["BlockPool"]


class BlockPool:
    """Page ids, ref counts and the hash -> page prefix cache of one replica."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, num_groups: int = 1) -> None:
        check_int("num_blocks", num_blocks, 1)
        check_int("num_groups", num_groups, 1)
        n = num_blocks
        self.num_blocks = n
        self.null_block = n
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = array("i", [0]) * n
        self._hash: list[BlockHash | None] = [None] * n
        self._group = bytearray(n)  # the group whose prefix cache holds the page's hash
        self._caches: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._cache = self._caches[0]
        self._fresh = array("i")
        self._fresh.frombytes(np.arange(n - 1, -1, -1, dtype=np.int32).tobytes())
        self._prev = array("i", [0]) * (n + 1)
        self._next = array("i", [0]) * (n + 1)
        self._prev[n] = self._next[n] = n  # empty circular list around the sentinel
        self._num_cached_free = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: fresh plus cached-evictable."""
        return len(self._fresh) + self._num_cached_free

    @property
    def num_used(self) -> int:
        """Pages with ref > 0."""
        return self.num_blocks - self.num_free

    @property
    def num_groups(self) -> int:
        """KV cache groups sharing the pool."""
        return len(self._caches)

    @property
    def num_cached(self) -> int:
        """Pages that hold a hash (in use or evictable), over every group."""
        return sum(len(c) for c in self._caches)

    def ref_count(self, page: int) -> int:
        """References to `page` (0 when free)."""
        return self._ref[page]

    def block_hash(self, page: int) -> BlockHash | None:
        """The hash `page` is cached under, or None."""
        return self._hash[page]

    def cached_page(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The page caching `block_hash` in `group`, or None."""
        return self._caches[group].get(block_hash)

    def lookup(self, hashes: list[BlockHash], start: int, stop: int, group: int = 0) -> list[int]:
        """Cached pages for ``hashes[start:stop]`` in `group`, stopping at the first miss. No side effects."""
        get = self._caches[group].get
        hits: list[int] = []
        for i in range(start, stop):
            page = get(hashes[i])
            if page is None:
                break
            hits.append(page)
        return hits

    def count_unreferenced(self, pages: Iterable[int]) -> int:
        """How many of `pages` have ref 0 (touching them takes them out of the free count)."""
        ref = self._ref
        return sum(1 for p in pages if ref[p] == 0)

    def free_order(self) -> list[int]:
        """The free pages in the order allocations will take them."""
        return [*reversed(self._fresh), *self._lru_pages()]

    def _lru_pages(self) -> Iterator[int]:
        nxt, sentinel = self._next, self.null_block
        page = nxt[sentinel]
        while page != sentinel:
            yield page
            page = nxt[page]

    # ------------------------------------------------------------------ mutations
    def touch(self, pages: Iterable[int]) -> None:
        """Add a reference to each of `pages` (cached pages leave the LRU list)."""
        ref, prv, nxt = self._ref, self._prev, self._next
        for page in pages:
            if ref[page] == 0:
                a, b = prv[page], nxt[page]
                nxt[a] = b
                prv[b] = a
                self._num_cached_free -= 1
            ref[page] += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages with ref 1: fresh ones first, then evict from the LRU head.

        Evicted pages lose their hash. Raises `InsufficientBlocksError` (and
        takes nothing) when ``n > num_free``.
        """
        if n > self.num_free:
            raise InsufficientBlocksError(
                f"Cannot get {n} free blocks (only {self.num_free} available)", needed=n, available=self.num_free
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

    def _evict(self, n: int) -> list[int]:
        prv, nxt, sentinel = self._prev, self._next, self.null_block
        hashes, caches, groups = self._hash, self._caches, self._group
        pages = []
        for _ in range(n):
            page = nxt[sentinel]
            b = nxt[page]
            nxt[sentinel] = b
            prv[b] = sentinel
            del caches[groups[page]][hashes[page]]  # type: ignore[arg-type]
            hashes[page] = None
            pages.append(page)
        self._num_cached_free -= n
        self.num_evictions += n
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page, in order; pages reaching 0 become free.

        Cached pages go to the LRU tail (still hittable), others to the fresh
        stack. The null page is ignored.
        """
        ref, hashes, fresh = self._ref, self._hash, self._fresh
        prv, nxt, sentinel = self._prev, self._next, self.null_block
        for page in pages:
            if page == sentinel:
                continue
            count = ref[page] - 1
            ref[page] = count
            if count:
                continue
            if hashes[page] is None:
                fresh.append(page)
            else:
                tail = prv[sentinel]
                nxt[tail] = page
                prv[page] = tail
                nxt[page] = sentinel
                prv[sentinel] = page
                self._num_cached_free += 1

    def commit(self, page: int, block_hash: BlockHash, group: int = 0) -> int:
        """Cache the full, written `page` under `block_hash` in `group`; returns the page to use.

        If another page already holds `block_hash` there, that page gains the
        caller's reference and `page` is freed (the caller must swap it in).
        """
        cache = self._caches[group]
        existing = cache.get(block_hash)
        if existing is None:
            cache[block_hash] = page
            self._hash[page] = block_hash
            self._group[page] = group
            return page
        if existing != page:
            self.touch((existing,))
            self.free((page,))
        return existing

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached page (they become fresh); returns how many.

        Pages in use keep their hashes, so running requests still commit and hit.
        """
        pages = list(self._lru_pages())
        hashes, caches, groups = self._hash, self._caches, self._group
        for page in pages:
            del caches[groups[page]][hashes[page]]  # type: ignore[arg-type]
            hashes[page] = None
        self._fresh.extend(reversed(pages))
        sentinel = self.null_block
        self._prev[sentinel] = self._next[sentinel] = sentinel
        self._num_cached_free = 0
        return len(pages)

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, holders: Mapping[int, int]) -> None:
        """Raise `IntegrityError` unless every page is in exactly one state.

        Args:
            holders: page -> number of references the request tables hold.
        """
        n, ref, hashes = self.num_blocks, self._ref, self._hash
        fresh = list(self._fresh)
        lru = list(self._lru_pages_checked())
        fresh_set, lru_set = set(fresh), set(lru)
        _require(len(fresh_set) == len(fresh), f"fresh stack has duplicates: {sorted(fresh)}")
        _require(not fresh_set & lru_set, f"pages both fresh and cached-free: {sorted(fresh_set & lru_set)}")
        _require(len(lru) == self._num_cached_free, f"LRU holds {len(lru)} pages, count says {self._num_cached_free}")
        _require(all(0 <= p < n for p in holders), f"request tables name pages outside [0, {n})")
        for page in range(n):
            held = holders.get(page, 0)
            _require(ref[page] == held, f"page {page}: ref {ref[page]} but {held} table references")
            is_free = page in fresh_set or page in lru_set
            _require(is_free == (held == 0), f"page {page}: ref {held} yet free={is_free}")
            if page in fresh_set:
                _require(hashes[page] is None, f"fresh page {page} still has a hash")
            if page in lru_set:
                _require(hashes[page] is not None, f"cached-free page {page} has no hash")
        for g, cache in enumerate(self._caches):
            for key, page in cache.items():
                _require(hashes[page] == key, f"prefix cache maps a hash to page {page}, which holds another")
                _require(self._group[page] == g, f"page {page} is cached in group {g} but marked {self._group[page]}")
        n_hashed = sum(h is not None for h in hashes)
        _require(n_hashed == self.num_cached, f"{n_hashed} hashed pages but {self.num_cached} cache entries")
        _require(self.enable_prefix_caching or not self.num_cached, "prefix cache used while disabled")

    def _lru_pages_checked(self) -> Iterator[int]:
        prv, nxt, sentinel = self._prev, self._next, self.null_block
        page, steps = nxt[sentinel], 0
        while page != sentinel:
            _require(prv[nxt[page]] == page, f"LRU link broken after page {page}")
            steps += 1
            _require(steps <= self.num_blocks, "LRU list has a cycle")
            yield page
            page = nxt[page]
