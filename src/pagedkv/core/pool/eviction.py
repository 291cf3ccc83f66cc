"""The eviction order of a pool's free cached pages: free lists and the keyed order, shared by every policy.

`BlockPool` keeps its free cached pages in intrusive doubly linked lists
(`FreeLists`: LRU, probation, protected, and queue-aware retention's WANTED)
and, under a list policy, evicts from their heads in the order its
`EvictionPolicy` chooses (`policies`). `HeapOrder` is the keyed order, for
policies that rank pages by a key (`EvictionPolicy.keyed`, e.g. LFU), for
retention priorities, evict leaves first, or an external key (the
offline-optimal bound). It is a lazy min-heap of ``(priority, rank, *key,
version, page)``, `key` the policy's `order_key`: every time a page enters
or moves within the LRU/probation lists the pool calls `listed(page)`, which
pushes a fresh entry (older entries of that page go stale and are skipped
when popped); `victim()` pops until it finds a page that is still free and
cached in an evictable list and (leaves first) has no cached child.

Retention priorities follow TensorRT-LLM: 0..100, default 35, lower evicted
first, each with an optional expiry after which the page drops back to the
default. Leaves first: a page whose chain child is cached is never evicted
while that child stays (so a chain is never cut in the middle), except when
only such pages are left (an allocation never fails for ordering reasons).
"""

from __future__ import annotations

import heapq
import time
from array import array
from collections.abc import Callable, Container, Iterator
from typing import TYPE_CHECKING, Any

from pagedkv.core.errors import require
from pagedkv.core.hashing import BlockHash

if TYPE_CHECKING:
    from pagedkv.core.pool.policies.base import EvictionPolicy

__all__ = [
    "FreeLists", "NONE", "LRU", "PROTECTED", "PROBATION", "WANTED", "HeapOrder", "check_order", "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
]  # fmt: skip

NONE, LRU, PROTECTED, PROBATION, WANTED = 0, 1, 2, 3, 4  # list ids (NONE: in no list; WANTED: `wanted`)


class FreeLists:
    """Four lists (LRU, PROTECTED, PROBATION, WANTED) of pages in ``[0, n)``, each head = oldest."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = array("i", [0]) * (n + 5)
        self.next = array("i", [0]) * (n + 5)
        self.sentinel = (0, n + 1, n + 2, n + 3, n + 4)  # indexed by list id (slot n is the null page's)
        for s in self.sentinel[1:]:
            self.prev[s] = self.next[s] = s  # empty circular lists
        self.where = bytearray(n)  # the list each page is in
        self.count = [0, 0, 0, 0, 0]  # pages per list

    def unlink(self, page: int) -> None:
        """Take `page` out of its list (it must be in one)."""
        prv, nxt = self.prev, self.next
        a, b = prv[page], nxt[page]
        nxt[a] = b
        prv[b] = a
        self.count[self.where[page]] -= 1
        self.where[page] = NONE

    def append(self, page: int, which: int) -> None:
        """Put `page` (in no list) at the tail of list `which`."""
        prv, nxt, sentinel = self.prev, self.next, self.sentinel[which]
        tail = prv[sentinel]
        nxt[tail] = page
        prv[page] = tail
        nxt[page] = sentinel
        prv[sentinel] = page
        self.count[which] += 1
        self.where[page] = which

    def extend(self, pages: list[int], which: int) -> None:
        """Put `pages` (in no list), in order, at the tail of list `which` (`append` for each, in one walk)."""
        if not pages:
            return
        prv, nxt, where, sentinel = self.prev, self.next, self.where, self.sentinel[which]
        tail = prv[sentinel]
        for page in pages:
            nxt[tail] = page
            prv[page] = tail
            where[page] = which
            tail = page
        nxt[tail] = sentinel
        prv[sentinel] = tail
        self.count[which] += len(pages)

    def take_head(self, which: int, k: int) -> list[int]:
        """Unlink the `k` oldest pages of list `which` (it must hold that many) and return them, oldest first."""
        nxt, prv, where, sentinel = self.next, self.prev, self.where, self.sentinel[which]
        pages = []
        page = nxt[sentinel]
        for _ in range(k):
            pages.append(page)
            where[page] = NONE
            page = nxt[page]
        nxt[sentinel] = page
        prv[page] = sentinel
        self.count[which] -= k
        return pages

    def take_head_unless(
        self, which: int, k: int, hashes: list[BlockHash | None], kept: Container[BlockHash | None]
    ) -> tuple[list[int], list[int]]:
        """Walk list `which` from its head, unlinking up to `k` pages whose hash is not in `kept` (oldest first),
        and passing over (leaving linked, at the head, in order) those whose hash is; stops at the list's end.
        Returns (unlinked pages, passed pages)."""
        if not kept:
            return self.take_head(which, min(k, self.count[which])), []
        nxt, prv, where, sentinel = self.next, self.prev, self.where, self.sentinel[which]
        taken: list[int] = []
        passed: list[int] = []
        page, left = nxt[sentinel], k
        while left and page != sentinel:
            following = nxt[page]
            if hashes[page] in kept:
                passed.append(page)
            else:  # (inlined `unlink`: this runs once per evicted page)
                before = prv[page]
                nxt[before] = following
                prv[following] = before
                where[page] = NONE
                taken.append(page)
                left -= 1
            page = following
        self.count[which] -= len(taken)
        return taken, passed

    def prepend(self, page: int, which: int) -> None:
        """Put `page` (in no list) at the head of list `which` (next to go)."""
        prv, nxt, sentinel = self.prev, self.next, self.sentinel[which]
        head = nxt[sentinel]
        prv[head] = page
        nxt[page] = head
        prv[page] = sentinel
        nxt[sentinel] = page
        self.count[which] += 1
        self.where[page] = which

    def move(self, page: int, which: int) -> None:
        """Move `page` (in some list) to the tail of list `which`."""
        self.unlink(page)
        self.append(page, which)

    def head(self, which: int) -> int:
        """The oldest page of list `which` (it must not be empty)."""
        return self.next[self.sentinel[which]]

    def pages(self, which: int) -> Iterator[int]:
        """The pages of list `which`, head first."""
        nxt, sentinel = self.next, self.sentinel[which]
        page = nxt[sentinel]
        while page != sentinel:
            yield page
            page = nxt[page]

    def checked_pages(self, which: int) -> list[int]:
        """The pages of list `which`, head first, checking every link on the way (`IntegrityError`
        for a broken link, a page marked in another list, a cycle, or a count that disagrees)."""
        prv, nxt, sentinel = self.prev, self.next, self.sentinel[which]
        pages: list[int] = []
        page = nxt[sentinel]
        while page != sentinel:
            require(prv[nxt[page]] == page, f"free list {which}: link broken after page {page}")
            require(self.where[page] == which, f"page {page} is in free list {which} but marked {self.where[page]}")
            require(len(pages) < self.n, f"free list {which} has a cycle")
            pages.append(page)
            page = nxt[page]
        require(len(pages) == self.count[which], f"free list {which} holds {len(pages)}, count {self.count[which]}")
        return pages


DEFAULT_PRIORITY = 35
MAX_PRIORITY = 100


class HeapOrder:
    """Keyed eviction order over pages ``[0, n)`` of one pool (see module docstring)."""

    def __init__(self, n: int, lists: FreeLists, reused: bytearray, stamps: array, policy: EvictionPolicy,
                 leaves_first: bool, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.policy = policy  # (the pool's: its `order_key` ranks pages, its keyed hooks hear of hits and cachings)
        self.policy_key = policy.order_key
        hooks = policy.listens  # (the hooks its class overrides; the others do nothing and are not called)
        self.on_hit = policy.hit if "hit" in hooks else None
        self.on_cached = policy.cached if "cached" in hooks else None
        self.on_forgotten = policy.forgotten if "forgotten" in hooks else None
        self.on_chosen = policy.chosen if "chosen" in hooks else None
        self.leaves_first = leaves_first
        self.clock = clock
        self.lists = lists
        self.reused = reused  # the pool's reuse bits and caching stamps (shared, not copied)
        self.stamps = stamps
        self.heap: list[tuple[Any, ...]] = []
        self.version = array("q", [0]) * n
        self.priority = bytearray([DEFAULT_PRIORITY]) * n
        self.expiry: dict[int, float] = {}  # page -> when its priority ends (pages with a non-default one)
        self.expiry_heap: list[tuple[float, int]] = []  # (when, page); stale unless expiry[page] == when
        self.deferred: dict[int, tuple[Any, ...]] = {}  # interior pages skipped by `victim`: their entry
        self.parent = array("i", [-1]) * n  # the chain parent page, while it is cached with the same stamp
        self.parent_stamp = array("q", [0]) * n
        self.children = array("i", [0]) * n  # cached chain children
        self.tick = 0
        self.last_use = array("q", [0]) * n  # the tick of each page's last listing
        self.key: Callable[[int], tuple[Any, ...]] | None = None  # an external key replaces the policy's
        self.rank: Callable[[int], float] | None = None  # queue-aware retention: ordered before the policy's key

    # ------------------------------------------------------------------ pool events
    def listed(self, page: int, refresh: bool = True) -> None:
        """`page` entered or moved within an evictable list (`refresh`: it was just used), or its
        priority changed (not `refresh`: it keeps its recency): push its current key."""
        if refresh:
            self.tick += 1
            self.last_use[page] = self.tick
        v = self.version[page] + 1
        self.version[page] = v
        tick = self.last_use[page]
        key = self.policy_key(page, tick, self.reused[page]) if self.key is None else self.key(page)
        rank = 0.0 if self.rank is None else self.rank(page)
        heapq.heappush(self.heap, (self.priority[page], rank, *key, v, page))
        if len(self.heap) > 4 * (self.lists.count[LRU] + self.lists.count[PROBATION]) + 1024:
            self._compact()

    def hit(self, page: int) -> None:
        """A request reused `page` (a prefix hit or a merge)."""
        if self.on_hit is not None:
            self.on_hit(page)

    def cached(self, page: int, parent: int, parent_stamp: int) -> None:
        """`page` was just cached as the chain child of `parent` (-1: a chain root)."""
        if self.on_cached is not None:
            self.on_cached(page)
        self.parent[page] = parent
        self.parent_stamp[page] = parent_stamp
        if parent >= 0:
            self.children[parent] += 1

    def forget(self, page: int) -> None:
        """`page` is about to lose its hash: drop its priority and its link to its parent, which may
        become a leaf (a parent skipped by `victim` for that reason gets its old entry back)."""
        self.version[page] += 1
        if self.on_forgotten is not None:
            self.on_forgotten(page)
        self.children[page] = 0
        self.deferred.pop(page, None)
        if self.priority[page] != DEFAULT_PRIORITY:
            self.priority[page] = DEFAULT_PRIORITY
            self.expiry.pop(page, None)
        parent = self.parent[page]
        self.parent[page] = -1
        if parent >= 0 and self.stamps[parent] == self.parent_stamp[page]:
            self.children[parent] -= 1
            entry = self.deferred.pop(parent, None) if not self.children[parent] else None
            if entry is not None and entry[-2] == self.version[parent]:
                heapq.heappush(self.heap, entry)

    def set_priority(self, page: int, priority: int, expires_at: float | None) -> None:
        """Give cached `page` `priority` until `expires_at` (None: no end)."""
        self.priority[page] = priority
        self.expiry.pop(page, None)
        if priority != DEFAULT_PRIORITY and expires_at is not None:
            self.expiry[page] = expires_at
            heapq.heappush(self.expiry_heap, (expires_at, page))
        if self.lists.where[page] in (LRU, PROBATION):
            self.listed(page, refresh=False)

    # ------------------------------------------------------------------ eviction
    def victim(self) -> int:
        """The next page to evict (the lists must hold at least one evictable page)."""
        self._expire()
        heap, version, where = self.heap, self.version, self.lists.where
        while heap:
            entry = heapq.heappop(heap)
            page = entry[-1]
            if entry[-2] != version[page] or where[page] not in (LRU, PROBATION):
                continue
            if self.leaves_first and self.children[page]:
                self.deferred[page] = entry  # pushed again by `forget` when its last child goes
                continue
            if self.on_chosen is not None and self.key is None:
                self.on_chosen(page, entry[2:-2])
            return page
        # only chain interiors are left (their children are held or protected): oldest list page
        return self.lists.head(PROBATION if self.lists.count[PROBATION] else LRU)

    def _expire(self) -> None:
        """Pages whose retention ended drop back to the default priority."""
        heap = self.expiry_heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            when, page = heapq.heappop(heap)
            if self.expiry.get(page) == when:
                self.set_priority(page, DEFAULT_PRIORITY, None)

    def _compact(self) -> None:
        version, where = self.version, self.lists.where
        self.heap = [e for e in self.heap if e[-2] == version[e[-1]] and where[e[-1]] in (LRU, PROBATION)]
        heapq.heapify(self.heap)


def check_order(order: HeapOrder, hashes: list[Any]) -> list[str]:
    """Violations of the keyed order's invariants (empty when sound): every evictable page has a live
    heap entry or a deferred one, and each page's child count equals its cached linked children."""
    errors: list[str] = []
    lists, version = order.lists, order.version
    live = {e[-1] for e in order.heap if e[-2] == version[e[-1]]}
    live.update(p for p, e in order.deferred.items() if e[-2] == version[p])
    for which in (LRU, PROBATION):
        missing = [p for p in lists.pages(which) if p not in live]
        if missing:
            errors.append(f"evictable pages without a live order entry: {missing[:8]}")
    counts = [0] * len(order.children)
    for page, h in enumerate(hashes):
        parent = order.parent[page]
        if (
            h is not None
            and parent >= 0
            and hashes[parent] is not None
            and order.stamps[parent] == order.parent_stamp[page]
        ):
            counts[parent] += 1
    bad = [p for p, h in enumerate(hashes) if h is not None and counts[p] != order.children[p]]
    if bad:
        errors.append(f"child counts wrong for pages {bad[:8]}")
    stray = [p for p, prio in enumerate(order.priority) if prio != DEFAULT_PRIORITY and hashes[p] is None]
    if stray:
        errors.append(f"uncached pages keep a retention priority: {stray[:8]}")
    return errors
