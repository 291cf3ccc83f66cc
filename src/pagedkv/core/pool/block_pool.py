"""`BlockPool`: the page pool of one replica (its page states, free lists, pins and storage: `pagedkv.core.pool`)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from pagedkv.core.errors import InsufficientBlocksError, require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool.eviction import (
    LRU,
    MAX_PRIORITY,
    NONE,
    PROBATION,
    PROTECTED,
    WANTED,
    FreeLists,
    HeapOrder,
    check_order,
)
from pagedkv.core.pool.policies import EVICTION_POLICIES, EvictionPolicy, make_eviction_policy
from pagedkv.core.pool.wanted import WantedPages
from pagedkv.params.validation import INT32_MAX, check_eviction, check_int

__all__ = ["BlockPool"]


class BlockPool:
    """Page ids, ref counts, pins and the hash -> page prefix caches of one replica.

    `eviction_policy`: the name of a registered `EvictionPolicy` (`EVICTION_POLICIES`: "lru", "slru",
    "lfu", "arc", ...); the pool builds it once (`policy`) and asks it which free page goes next.
    `leaves_first`: never evict a page while its chain child is cached. `protected_fraction`: at most
    this share of the pages sits in the protected list; a pinned page freed while it is full goes to
    the LRU like any other. List policies evict from list heads; keyed ones (`EvictionPolicy.keyed`),
    `leaves_first` and retention priorities (`set_priority`) use a keyed `HeapOrder`.
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
        check_eviction(eviction_policy, protected_fraction, leaves_first, EVICTION_POLICIES)
        self.eviction_policy = eviction_policy
        self.policy: EvictionPolicy = make_eviction_policy(eviction_policy, num_blocks)
        self._segmented = self.policy.segmented  # (never-reused pages wait in probation)
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
        self._fresh = array("i")
        self._fresh.frombytes(np.arange(n - 1, -1, -1, dtype=np.int32).tobytes())
        self._lists = FreeLists(n)
        self.protected_fraction = protected_fraction
        self.max_protected = int(n * protected_fraction)  # cap on the protected list
        self.num_evictions = 0
        self.on_removed: Callable[[BlockHash, int], None] | None = None  # (hash, group) of each page forgotten
        self.on_uncached: list[Callable[[int], None]] = []  # called with each page that loses its hash
        self.leaves_first = leaves_first
        self._wants = WantedPages(self._lists, self._hash, self._caches)  # queue-aware retention
        self._wanted = self._wants.tickets  # prefix keys -> tickets of waiting requests (`want`)
        self._order: HeapOrder | None = None
        if self.policy.keyed or leaves_first:
            self.keyed_order()

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

    def hold(self, pages: Iterable[int]) -> None:
        """Add a reference to each of `pages` already held, without counting a hit (no recency, reuse or
        frequency change): keeps them from eviction while their holder's other pages are freed."""
        ref, pages = self._ref, list(pages)
        for page in pages:  # (checked first: a refused call changes nothing)
            if ref[page] < 1:
                raise ValueError(f"page {page} is not held")
        for page in pages:
            ref[page] += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages with ref 1: fresh ones first, then evict (probation, then LRU).

        Protected pages are never taken here (see `take`). Evicted pages lose
        their hash and their pins. Raises `InsufficientBlocksError` (and takes
        nothing) when there are fewer than `n` such pages.
        """
        fresh, ref = self._fresh, self._ref
        if n == 1 and fresh:  # (a decode step's page: the top of the fresh stack, nothing to check)
            page = fresh.pop()
            ref[page] = 1
            return [page]
        free = self.num_free - self.num_protected
        if n > free:
            raise InsufficientBlocksError(
                f"Cannot get {n} free blocks (only {free} available)", needed=n, available=free
            )
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
        lists, fresh, order = self._lists, self._fresh, self._order
        if not (order or self.policy.page_by_page or fresh or self.on_uncached or self.on_removed):
            return self._evict_listed(n)  # (list order, no hook: runs of pages, no call per page)
        pages = []
        evicted = 0
        for _ in range(n):
            if fresh:  # (an `on_uncached` hook freed more pages with a victim: a checkpoint's run)
                pages.append(fresh.pop())
                continue
            evicted += 1
            page = order.victim() if order is not None else self._wants.next_victim(self.policy)
            lists.unlink(page)
            self._uncache(page)
            pages.append(page)
        self.num_evictions += evicted
        return pages

    def _evict_listed(self, n: int) -> list[int]:
        """`n` victims in `WantedPages.next_victim`'s order, taken in runs (`WantedPages.take`: no keyed order, hook
        or policy asked page by page), each losing its hash as `_uncache` does."""
        pages, hashes = self._wants.take(n), self._hash
        group, caches, reused, pins, stamp = self._group, self._caches, self._reused, self._pins, self._stamp
        for page in pages:  # (inlined `_uncache` without hooks: this runs once per evicted page)
            del caches[group[page]][hashes[page]]  # type: ignore[arg-type]
            hashes[page] = None
            reused[page] = pins[page] = stamp[page] = 0
        self.num_evictions += n
        return pages

    def want(self, keys: Iterable[BlockHash], ticket: float, delta: int = 1) -> None:
        """Queue-aware retention: a waiting request (its place in the queue: `ticket`, lower is sooner) will hit
        the pages cached under `keys` (in every group: a hybrid model's groups share the prefix keys); `delta`
        -1 withdraws that want. Free cached pages no waiting request wants are evicted first (in the policy's
        order), then wanted ones, those wanted latest first (Belady's rule over the known queue); retention
        priorities still come first. Costs O(keys), plus the pages already set aside (`WantedPages`); under the list
        policies the want waits for the next eviction, and one withdrawn before it costs O(1)."""
        self._wants.want(keys, ticket, delta, self._order, self._rank)

    def note_misses(self, keys: Sequence[BlockHash]) -> None:
        """A prefix lookup wanted the pages of `keys` and found none of them cached: the policy may adapt
        (ARC's split, on a key evicted lately); the others ignore it. Changes no page."""
        self.policy.missed(keys)

    def _rank(self, page: int) -> float:
        return self._wants.rank(self._hash[page])

    def can_allocate_unwanted(self, n: int) -> bool:
        """Whether `allocate(n)` can take its pages without evicting a free cached page some waiting request
        wants (`want`). Changes nothing observable (it may apply deferred wants); wanted pages are counted only
        when fresh ones fall short."""
        free = self.num_free - self.num_protected
        if free < n or len(self._fresh) >= n or not self._wants:
            return free >= n
        return self._wants.count_free(free - n) <= free - n

    @property
    def num_wanted(self) -> int:
        """Distinct hashes waiting requests want kept (cached or not)."""
        self._wants.flush()
        return len(self._wanted)

    def forget(self, page: int) -> None:
        """Drop the hash of held `page` without a removal event: it was committed before its KV was
        written (`commit_on_alloc`) and the write never happened, so no listener ever heard of it."""
        if self._ref[page] < 1 or self._hash[page] is None:
            raise ValueError(f"page {page} is not held and cached")
        self._uncache(page, announce=False)

    def uncache(self, pages: Iterable[int]) -> int:
        """Take `pages` out of the prefix cache, announcing each removal (`on_removed`): their content
        is no longer what their hash says (a tier copy into them failed). A free one becomes fresh; a
        held one stays held, unhashed, so no later request hits it. Not counted as evictions.
        Returns how many were cached."""
        where, done = self._lists.where, 0
        for page in pages:
            if self._hash[page] is None:
                continue
            if where[page] != NONE:  # free and cached
                self._lists.unlink(page)
                self._uncache(page)
                self._fresh.append(page)
            else:
                self._uncache(page)
            done += 1
        return done

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
        plain = LRU if not self._segmented else 0  # the list of an unpinned page, when it does not depend on reuse
        run: list[int] = []  # (unpinned pages bound for the LRU tail, linked in one walk when no keyed order)
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
            if which == LRU and order is None:
                run.append(page)
                continue
            append(page, which)
            if order is not None and which != PROTECTED:
                order.listed(page)
        self._lists.extend(run, LRU)

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
        return self._unpinned_list(page)

    def _unpinned_list(self, page: int) -> int:
        return PROBATION if self._segmented and not self._reused[page] else LRU

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
        self._wants.restore_all(self._unpinned_list)  # (set-aside pages back at their lists' heads, oldest first)
        pages = [*self.list_pages(LRU), *self.list_pages(PROBATION)]
        done = []
        for page in pages:
            if self._hash[page] is None:  # (an `on_uncached` hook uncached it with another page: fresh already)
                continue
            self._lists.unlink(page)
            self._uncache(page)
            done.append(page)
        self._fresh.extend(reversed(done))
        return len(done)

    # ------------------------------------------------------------------ retention
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
        order = self.keyed_order()
        expires = None if duration_s is None else order.clock() + duration_s
        for page in pages:
            order.set_priority(page, priority, expires)

    def retain(self, pages: Iterable[int], priority: int, duration_s: float | None) -> None:
        """Raise the retention priority of cached `pages` to `priority` for `duration_s` seconds from
        now (None: while cached); pages already at a higher priority keep theirs."""
        order = self.keyed_order()
        expires = None if duration_s is None else order.clock() + duration_s
        current = order.priority
        for page in pages:
            if self._hash[page] is not None and current[page] <= priority:
                order.set_priority(page, priority, expires)

    def keyed_order(self) -> HeapOrder:
        """The keyed eviction order, built on first use from the lists' current order."""
        if self._order is None:
            self._wants.flush()  # (a keyed order applies every want at once)
            self._wants.restore_all(self._unpinned_list)  # (the heap ranks wanted pages from now on)
            order = HeapOrder(self.num_blocks, self._lists, self._reused, self._stamp, self.policy, self.leaves_first)
            if self._wants:
                order.rank = self._rank
            for page in [*self._lists.pages(PROBATION), *self._lists.pages(LRU)]:
                order.listed(page)
            self._order = order
        return self._order

    # ------------------------------------------------------------------ queries (no side effects)
    @property
    def num_free(self) -> int:
        """Pages an allocation can take: fresh plus cached free (protected ones included)."""
        count = self._lists.count
        return len(self._fresh) + count[LRU] + count[PROTECTED] + count[PROBATION] + count[WANTED]

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

    def group_of(self, page: int) -> int:
        """The group whose prefix cache holds cached `page` (meaningless for an uncached page)."""
        return self._group[page]

    def block_hash(self, page: int) -> BlockHash | None:
        """The hash `page` is cached under, or None."""
        return self._hash[page]

    def cached_page(self, block_hash: BlockHash, group: int = 0) -> int | None:
        """The page caching `block_hash` in `group`, or None."""
        return self._caches[group].get(block_hash)

    def lookup(self, hashes: list[BlockHash], start: int, stop: int, group: int = 0) -> list[int]:
        """Cached pages for ``hashes[start:stop]`` in `group`, stopping at the first miss. No side effects."""
        cache = self._caches[group]
        if start >= stop or hashes[start] not in cache:  # (a prompt nobody shares misses at once)
            return []
        hits = list(map(cache.get, hashes[start:stop]))
        return hits[: hits.index(None)] if None in hits else hits  # type: ignore[return-value]

    def count_unreferenced(self, pages: Iterable[int]) -> int:
        """How many of `pages` have ref 0 (touching them takes them out of the free count)."""
        return list(map(self._ref.__getitem__, pages)).count(0)

    def free_order(self) -> list[int]:
        """The free pages in the order allocations will take them (list order: a policy's own split, e.g.
        ARC's, and the keyed order are ignored)."""
        listed = [*self.list_pages(PROBATION), *self.list_pages(LRU)]
        if self._order is not None or not (self._wants or self._lists.count[WANTED]):
            return [*reversed(self._fresh), *listed, *self.list_pages(PROTECTED)]
        wanted = self._wants.ordered(listed)  # (first: it applies the deferred wants)
        unwanted = [p for p in listed if self._hash[p] not in self._wanted]
        return [*reversed(self._fresh), *wanted[0], *unwanted, *wanted[1], *self.list_pages(PROTECTED)]

    def list_pages(self, which: int) -> Iterator[int]:
        """The pages of free list `which` (1: LRU, 2: protected, 3: SLRU probation), head first."""
        return self._lists.pages(which)

    # ------------------------------------------------------------------ invariants
    def check_integrity(self, holders: Mapping[int, int], pins: Mapping[int, int] | None = None) -> None:
        """Raise `IntegrityError` unless each page is in use (ref = table references), cached and free
        (in a free list, with a hash; protected iff pinned), or fresh (on the stack, no hash), and its
        pins are the live pins the requests hold. O(pages): for tests and runtime checks.

        Args:
            holders: page -> number of references the request tables hold.
            pins: page -> live pins the requests hold (None: no pins expected).
        """
        pins = pins or {}
        n, ref, hashes, where = self.num_blocks, self._ref, self._hash, self._lists.where
        fresh = list(self._fresh)
        lists = [self._lists.checked_pages(which) for which in (LRU, PROTECTED, PROBATION, WANTED)]
        fresh_set, cached_set = set(fresh), {p for pages in lists for p in pages}
        require(len(fresh_set) == len(fresh), f"fresh stack has duplicates: {sorted(fresh)}")
        require(not fresh_set & cached_set, f"pages both fresh and cached-free: {sorted(fresh_set & cached_set)}")
        require(all(0 <= p < n for p in holders), f"request tables name pages outside [0, {n})")
        for page in range(n):
            held = holders.get(page, 0)
            require(ref[page] == held, f"page {page}: ref {ref[page]} but {held} table references")
            is_free = page in fresh_set or page in cached_set
            require(is_free == (held == 0), f"page {page}: ref {held} yet free={is_free}")
            if page in fresh_set:
                require(hashes[page] is None, f"fresh page {page} still has a hash")
            n_pins = pins.get(page, 0)
            require(self._pins[page] == n_pins, f"page {page}: {self._pins[page]} pins but requests hold {n_pins}")
            require(not n_pins or hashes[page] is not None, f"page {page} is pinned but not cached")
            if page in cached_set:
                require(hashes[page] is not None, f"cached-free page {page} has no hash")
                require(where[page] != PROTECTED or n_pins > 0, f"free page {page} is protected without a pin")
            else:
                require(where[page] == NONE, f"page {page} is marked in free list {where[page]} it is not in")
        for g, cache in enumerate(self._caches):
            for key, page in cache.items():
                require(hashes[page] == key, f"prefix cache maps a hash to page {page}, which holds another")
                require(self._group[page] == g, f"page {page} is cached in group {g} but marked {self._group[page]}")
        require(self.num_protected <= self.max_protected,
                f"{self.num_protected} protected pages, over the cap of {self.max_protected}")  # fmt: skip
        n_hashed = sum(h is not None for h in hashes)
        require(n_hashed == self.num_cached, f"{n_hashed} hashed pages but {self.num_cached} cache entries")
        require(self.enable_prefix_caching or not self.num_cached, "prefix cache used while disabled")
        self._wants.check(keyed=self._order is not None)
        if self._order is not None:
            errors = check_order(self._order, hashes)
            require(not errors, "; ".join(errors))
