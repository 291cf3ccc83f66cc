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

A second, *protected* list holds cached pages a running request dropped out
of its attention window: they are free (an allocation may take them) but
evicted only after the whole LRU, and move to the LRU when their request
ends (`release`). A running request's prefix thus stays whole in every group.

Storage is struct-of-arrays (26 bytes per page before any caching): int32
ref counts, int32 prev/next links of the two lists (sentinels: the null page
id and the one after), an int32 fresh stack, one slot per page for its hash,
one byte for the group that cached it and one for the list it is in. Building a pool of a million pages takes
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
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool_checks import check_pool
from pagedkv.validation import check_int

__all__ = ["BlockPool"]

_NONE, _LRU, _PROTECTED, _PROBATION = 0, 1, 2, 3  # which free list a page is in
EVICTION_POLICIES = ("lru", "slru")


class BlockPool:
    """Page ids, ref counts and the hash -> page prefix caches of one replica.

    `eviction_policy`: "lru", or "slru" (segmented LRU: cached pages never reused since they were
    cached are evicted before pages that served a hit, each segment in LRU order).
    """

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, num_groups: int = 1, eviction_policy: str = "lru"
    ) -> None:
        check_int("num_blocks", num_blocks, 1)
        check_int("num_groups", num_groups, 1)
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy={eviction_policy!r} must be one of {EVICTION_POLICIES}")
        self.eviction_policy = eviction_policy
        self._slru = eviction_policy == "slru"
        n = num_blocks
        self.num_blocks = n
        self.null_block = n
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = array("i", [0]) * n
        self._hash: list[BlockHash | None] = [None] * n
        self._group = bytearray(n)  # the group whose prefix cache holds the page's hash
        self._where = bytearray(n)  # _NONE, _LRU, _PROTECTED or _PROBATION
        self._reused = bytearray(n)  # 1 once a cached page was hit or merged into (SLRU's "frequent")
        self._caches: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._cache = self._caches[0]
        self._fresh = array("i")
        self._fresh.frombytes(np.arange(n - 1, -1, -1, dtype=np.int32).tobytes())
        self._prev = array("i", [0]) * (n + 3)
        self._next = array("i", [0]) * (n + 3)
        self._sentinel = (0, n, n + 1, n + 2)  # list heads, indexed by _LRU / _PROTECTED / _PROBATION
        for s in self._sentinel[1:]:
            self._prev[s] = self._next[s] = s  # empty circular lists
        self._count = [0, 0, 0, 0]  # pages per list
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: fresh plus cached-evictable (protected included)."""
        count = self._count
        return len(self._fresh) + count[_LRU] + count[_PROTECTED] + count[_PROBATION]

    @property
    def num_protected(self) -> int:
        """Free cached pages in the protected list (evicted last)."""
        return self._count[_PROTECTED]

    def is_protected(self, page: int) -> bool:
        """True when `page` is free in the protected list."""
        return self._where[page] == _PROTECTED

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
        return [
            *reversed(self._fresh),
            *self.list_pages(_PROBATION),
            *self.list_pages(_LRU),
            *self.list_pages(_PROTECTED),
        ]

    def list_pages(self, which: int) -> Iterator[int]:
        """The pages of free list `which` (1: LRU, 2: protected, 3: SLRU probation), head first."""
        nxt, sentinel = self._next, self._sentinel[which]
        page = nxt[sentinel]
        while page != sentinel:
            yield page
            page = nxt[page]

    # ------------------------------------------------------------------ list plumbing
    def _unlink(self, page: int) -> None:
        prv, nxt = self._prev, self._next
        a, b = prv[page], nxt[page]
        nxt[a] = b
        prv[b] = a
        self._count[self._where[page]] -= 1
        self._where[page] = _NONE

    def _append(self, page: int, which: int) -> None:
        prv, nxt, sentinel = self._prev, self._next, self._sentinel[which]
        tail = prv[sentinel]
        nxt[tail] = page
        prv[page] = tail
        nxt[page] = sentinel
        prv[sentinel] = page
        self._count[which] += 1
        self._where[page] = which

    # ------------------------------------------------------------------ mutations
    def touch(self, pages: Iterable[int]) -> None:
        """Add a reference to each of `pages` (a prefix hit or merge: cached pages leave their free list)."""
        ref, reused = self._ref, self._reused
        for page in pages:
            if ref[page] == 0:
                self._unlink(page)
            ref[page] += 1
            reused[page] = 1

    def allocate(self, n: int, protected_ok: bool = True) -> list[int]:
        """Take `n` pages with ref 1: fresh ones first, then evict from the LRU head, then protected
        (unless `protected_ok` is False).

        Evicted pages lose their hash. Raises `InsufficientBlocksError` (and
        takes nothing) when there are fewer than `n` such pages.
        """
        free = self.num_free if protected_ok else self.num_free - self._count[_PROTECTED]
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
            if self._where[page] == _NONE or self._ref[page]:
                raise ValueError(f"page {page} is not free and cached")
        for page in pages:
            self._unlink(page)
            del self._caches[self._group[page]][self._hash[page]]  # type: ignore[arg-type]
            self._hash[page] = None
            self._reused[page] = 0
            self._ref[page] = 1
        self.num_evictions += len(pages)
        return list(pages)

    def _evict(self, n: int) -> list[int]:
        hashes, caches, groups, nxt = self._hash, self._caches, self._group, self._next
        pages = []
        count = self._count
        for _ in range(n):
            which = _PROBATION if count[_PROBATION] else _LRU if count[_LRU] else _PROTECTED
            page = nxt[self._sentinel[which]]
            self._unlink(page)
            self._reused[page] = 0
            del caches[groups[page]][hashes[page]]  # type: ignore[arg-type]
            hashes[page] = None
            pages.append(page)
        self.num_evictions += n
        return pages

    def free(self, pages: Iterable[int], protect: bool = False) -> None:
        """Drop one reference from each page, in order; pages reaching 0 become free.

        Cached pages go to the LRU tail (the protected tail with `protect`; under
        SLRU, the probation tail until first reused), still hittable; others
        to the fresh stack. The null page is ignored.
        """
        ref, hashes, fresh, null = self._ref, self._hash, self._fresh, self.null_block
        for page in pages:
            if page == null:
                continue
            count = ref[page] - 1
            ref[page] = count
            if count:
                continue
            if hashes[page] is None:
                fresh.append(page)
            else:
                self._append(page, _PROTECTED if protect else self._cached_list(page))

    def release(self, pages: Iterable[int], held: Iterable[bool]) -> None:
        """In one pass over `pages`: drop a reference from each held page (as `free`), and move each
        page that is not held but sits free and cached (LRU or protected) to the LRU tail."""
        where = self._where
        for page, is_held in zip(pages, held, strict=True):
            if is_held:
                self.free((page,))
            elif where[page] != _NONE:
                self._unlink(page)
                self._append(page, self._cached_list(page))

    def _cached_list(self, page: int) -> int:
        return _PROBATION if self._slru and not self._reused[page] else _LRU

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
        pages = [*self.list_pages(_LRU), *self.list_pages(_PROTECTED), *self.list_pages(_PROBATION)]
        hashes, caches, groups = self._hash, self._caches, self._group
        for page in pages:
            self._unlink(page)
            del caches[groups[page]][hashes[page]]  # type: ignore[arg-type]
            hashes[page] = None
            self._reused[page] = 0
        self._fresh.extend(reversed(pages))
        return len(pages)

    def check_integrity(self, holders: Mapping[int, int]) -> None:
        """Raise `IntegrityError` unless every page is in exactly one state (see `pool_checks`).

        Args:
            holders: page -> number of references the request tables hold.
        """
        check_pool(self, holders)
