"""`PoolQueries`: the read-only side of `BlockPool` (counts, lookups, page state). No side effects."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

from pagedkv.core.free_lists import LRU, PROBATION, PROTECTED, FreeLists
from pagedkv.core.hashing import BlockHash

__all__ = ["PoolQueries"]


class PoolQueries:
    """Queries over the pool's state arrays (mixed into `BlockPool`, which owns and mutates them)."""

    num_blocks: int
    _ref: array
    _pins: array
    _stamp: array
    _hash: list[BlockHash | None]
    _reused: bytearray
    _caches: list[dict[BlockHash, int]]
    _fresh: array
    _lists: FreeLists

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: fresh plus cached free (protected ones included)."""
        count = self._lists.count
        return len(self._fresh) + count[LRU] + count[PROTECTED] + count[PROBATION]

    @property
    def num_protected(self) -> int:
        """Free pinned pages (evicted last)."""
        return self._lists.count[PROTECTED]

    def is_protected(self, page: int) -> bool:
        """True when `page` is free and pinned."""
        return self._lists.where[page] == PROTECTED

    def is_reused(self, page: int) -> bool:
        """True when cached `page` served a hit or a merge since it was cached."""
        return bool(self._reused[page])

    def pin_count(self, page: int) -> int:
        """Pins on `page` (0 when none)."""
        return self._pins[page]

    def stamp(self, page: int) -> int:
        """The caching of `page` a pin taken now refers to (changes when it is evicted and re-cached)."""
        return self._stamp[page]

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
        return [*reversed(self._fresh), *self.list_pages(PROBATION), *self.list_pages(LRU), *self.list_pages(PROTECTED)]

    def list_pages(self, which: int) -> Iterator[int]:
        """The pages of free list `which` (1: LRU, 2: protected, 3: SLRU probation), head first."""
        return self._lists.pages(which)
