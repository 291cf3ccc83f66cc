"""`WantedPages`: queue-aware retention's wants in one pool, and the order of the free cached pages they keep.

A waiting request (its place in the queue: a ticket, lower is sooner) wants the pages cached under its
prompt's prefix keys (`BlockPool.want`). Free cached pages nobody wants are evicted first, in the pool's own
order; then wanted ones, those whose first (soonest) want is latest first, ties in the order the pool's lists
held them.

Under the list policies (lru, slru, arc: every policy that is not `keyed`, while no page has a retention
priority) wants are kept lazily, so they cost nothing per freed page: a wanted page stays in its list until
eviction reaches it at the head, and is then *set aside* into the WANTED list with a heap entry ``(rank,
set-aside sequence, page)``, rank = minus its first ticket (an entry is live while both still hold). Pages
reach the head oldest first, so the sequence keeps their list order. A want that changes re-ranks only pages
already set aside; one that nobody wants any more ranks `UNWANTED` and is evicted before every listed page
(older than all of them, it would have gone already). Under a keyed `HeapOrder` (lfu, leaves first,
priorities) the pool puts the rank into every heap key instead (`rank`), and no page is set aside.

Under the list policies a want is also *deferred* (`want`): it waits, by ticket, until something reads the wants
(the next eviction, `count_free`, `ordered`); one withdrawn before that costs nothing. In a pool that seldom
evicts, the requests that pass through the queue never touch the tickets; where it evicts every step, each want
is applied once, at the next eviction, in ticket order, with the same tickets, ranks and victims as at once.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from itertools import repeat

from pagedkv.core.errors import require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool.eviction import LRU, NONE, PROBATION, WANTED, FreeLists, HeapOrder
from pagedkv.core.pool.policies import EvictionPolicy

__all__ = ["WantedPages", "UNWANTED"]

UNWANTED = float("-inf")  # the rank of a page no waiting request wants (evicted first)


class WantedPages:
    """Tickets per prefix key, and the set-aside wanted pages of one pool (see module docstring).

    `lists`, `hashes` and `caches` are the pool's own (shared, not copied)."""

    def __init__(self, lists: FreeLists, hashes: list[BlockHash | None], caches: list[dict[BlockHash, int]]) -> None:
        self.tickets: dict[BlockHash, float | deque[float]] = {}  # prefix key -> ticket(s) of those wanting it
        self.lists, self.hashes, self.caches = lists, hashes, caches
        self.heap: list[tuple[float, int, int]] = []  # (rank, sequence, page); stale entries are skipped
        self.sequence = array("q", [0]) * lists.n  # when each set-aside page was set aside
        self.next_sequence = 0
        self.top = float("-inf")  # no want was ever added with a later ticket (a bound: withdrawals keep it)
        self.pending: dict[float, list[BlockHash]] = {}  # deferred wants by ticket (`want`, `flush`)
        self.released = False  # a set-aside page may have lost its last want since the last check (`victim`)

    def __bool__(self) -> bool:
        return bool(self.tickets or self.pending)

    def want(self, keys: Iterable[BlockHash], ticket: float, delta: int, order: HeapOrder | None,
             rank: Callable[[int], float]) -> None:  # fmt: skip
        """`BlockPool.want`: add (`delta` 1) or withdraw (-1) `ticket`'s want of `keys`. Under the list policies
        (`order` None) an add waits in `pending` until `flush`, and withdrawing it (the same keys) drops it;
        anything else is applied at once (`update`, `apply`)."""
        keys = keys if type(keys) is list else list(keys)
        if order is None:
            pending = self.pending
            if delta > 0 and ticket not in pending:
                pending[ticket] = keys
                return
            if delta < 0:
                waiting = pending.get(ticket)
                if waiting is not None and (waiting is keys or waiting == keys):
                    del pending[ticket]
                    return
            self.flush()
        self.apply(self.update(keys, ticket, delta), order, rank)

    def flush(self) -> None:
        """Apply the deferred wants, in ticket order (before anything reads the tickets)."""
        if self.pending:
            pending, self.pending = self.pending, {}
            for ticket in sorted(pending):
                self.reranked(self.update(pending[ticket], ticket, 1))

    def update(self, keys: Iterable[BlockHash], ticket: float, delta: int) -> list[BlockHash]:
        """Add (`delta` 1) or withdraw (-1) `ticket`'s want of each key; returns the keys whose first
        ticket changed (their pages' rank). A key wanted once holds its ticket, one wanted more often a
        sorted deque of them. A prompt's keys wanted by nobody else (the common case) take one C-level
        pass each way."""
        keys = keys if type(keys) is list else list(keys)
        wanted = self.tickets
        if delta < 0:
            if list(map(wanted.get, keys)).count(ticket) == len(keys):  # (its own tickets alone)
                deque(map(wanted.pop, keys, repeat(None)), maxlen=0)
                return keys
            return self._withdraw(keys, ticket)
        top, self.top = self.top, max(self.top, ticket)
        if wanted.keys().isdisjoint(keys):  # (a chain's keys are distinct: no key twice in `keys`)
            wanted.update(zip(keys, repeat(ticket)))
            return keys
        if ticket >= top:  # (queued behind every want: the first ticket changes only where there was none)
            return self._add_last(keys, ticket)
        changed = []
        for key in keys:  # (queued ahead of others: a preempted request put back at the front)
            tickets = wanted.get(key)
            if tickets is None:
                wanted[key] = ticket
                changed.append(key)
            elif not isinstance(tickets, deque):  # wanted once
                wanted[key] = deque((tickets, ticket) if ticket >= tickets else (ticket, tickets))
                if ticket < tickets:
                    changed.append(key)
            elif ticket >= tickets[-1]:
                tickets.append(ticket)
            elif ticket <= tickets[0]:
                if ticket < tickets[0]:
                    changed.append(key)
                tickets.appendleft(ticket)
            else:  # (between two others: rare)
                tickets.insert(bisect.bisect_left(list(tickets), ticket), ticket)
        return changed

    def _add_last(self, keys: list[BlockHash], ticket: float) -> list[BlockHash]:
        """`update`'s add of a ticket no want is later than: queued behind each; new keys change."""
        wanted, changed = self.tickets, []
        for key, tickets in zip(keys, map(wanted.get, keys), strict=True):
            if tickets is None:
                wanted[key] = ticket
                changed.append(key)
            elif isinstance(tickets, deque):
                tickets.append(ticket)
            else:
                wanted[key] = deque((tickets, ticket))
        return changed

    def _withdraw(self, keys: list[BlockHash], ticket: float) -> list[BlockHash]:
        """`update`'s withdrawal of `ticket` from `keys`: the keys whose first ticket changed."""
        wanted, changed = self.tickets, []
        for key, tickets in zip(keys, map(wanted.get, keys), strict=True):
            if isinstance(tickets, deque):
                if tickets[0] == ticket:  # (the queue's head leaves first: O(1))
                    tickets.popleft()
                else:
                    with contextlib.suppress(ValueError):
                        tickets.remove(ticket)
                    continue  # (its first ticket stays)
                if not tickets:
                    del wanted[key]
                changed.append(key)
            elif tickets == ticket:
                del wanted[key]
                changed.append(key)
        return changed

    def rank(self, block_hash: BlockHash | None) -> float:
        """Minus the first ticket wanting `block_hash` (higher is kept longer), `UNWANTED` when none."""
        tickets = self.tickets.get(block_hash)  # type: ignore[arg-type]
        if tickets is None:
            return UNWANTED
        return -(tickets[0] if isinstance(tickets, deque) else tickets)

    def apply(self, changed: list[BlockHash], order: HeapOrder | None, rank: Callable[[int], float]) -> None:
        """The first tickets of `changed` moved: re-rank their pages. Lazily under the list policies (`order`
        None: only pages set aside); under the pool's keyed `order`, a new heap entry for each free page of
        theirs in every group, and on the first want, `rank` (page -> rank) for every evictable page."""
        if order is None:
            self.reranked(changed)
            return
        lists = self.lists
        if order.rank is None:  # (every evictable page gets its rank: unwanted ones go first from now on)
            order.rank = rank
            for page in [*lists.pages(PROBATION), *lists.pages(LRU)]:
                order.listed(page, refresh=False)
            return
        for key in changed:
            for cache in self.caches:
                cached = cache.get(key)
                if cached is not None and lists.where[cached] in (LRU, PROBATION):
                    order.listed(cached, refresh=False)

    def count_free(self, limit: int) -> int:
        """Wanted free cached pages over every group, counted until the count passes `limit`."""
        self.flush()
        where, count = self.lists.where, 0
        for page in (cache.get(key) for key in self.tickets for cache in self.caches):
            count += page is not None and where[page] in (LRU, PROBATION, WANTED)
            if count > limit:
                break
        return count

    # ------------------------------------------------------------------ lazy order (list policies)
    def set_aside(self, page: int) -> None:
        """Move wanted free `page` from the head of its list to the WANTED list, ranked."""
        self.lists.unlink(page)
        self.lists.append(page, WANTED)
        seq = self.next_sequence
        self.next_sequence = seq + 1
        self.sequence[page] = seq
        self._push(page)

    def next_victim(self, policy: EvictionPolicy) -> int:
        """The next page to evict by list order (`policy.from_probation` picks the list; `policy.evicted` hears
        of the victim), unlinked by the caller, setting aside each wanted page it passes: set-aside pages nobody
        wants any more go first, wanted ones last (`take`'s order one page at a time, for any policy; the
        caller makes sure a free cached page exists)."""
        self.flush()
        lists, count, tickets, hashes = self.lists, self.lists.count, self.tickets, self.hashes
        if self.released and (page := self.victim(unwanted_only=True)) >= 0:
            return page
        while count[PROBATION] or count[LRU]:
            t1 = policy.from_probation(count[PROBATION], count[LRU])
            page = lists.head(PROBATION if t1 else LRU)
            if tickets and hashes[page] in tickets:
                self.set_aside(page)
                continue
            policy.evicted(hashes[page], t1)  # type: ignore[arg-type]
            return page
        return self.victim()  # (>= 0: the pool's free count includes every set-aside page)

    def _set_aside_heads(self, pages: list[int], which: int) -> None:
        """`set_aside` each of `pages`, wanted pages that are, in order, the first pages of list `which`."""
        lists, hashes, tickets, heap, sequence = self.lists, self.hashes, self.tickets, self.heap, self.sequence
        lists.take_head(which, len(pages))
        lists.extend(pages, WANTED)
        first = self.next_sequence
        self.next_sequence = first + len(pages)
        push = heapq.heappush
        for seq, page in enumerate(pages, first):  # (inlined `_push` and `rank`: once per page set aside)
            sequence[page] = seq
            wanting = tickets[hashes[page]]  # type: ignore[index]
            push(heap, (-(wanting[0] if isinstance(wanting, deque) else wanting), seq, page))
        if len(heap) > 4 * lists.count[WANTED] + 1024:
            self._compact()

    def _push(self, page: int) -> None:
        heapq.heappush(self.heap, (self.rank(self.hashes[page]), self.sequence[page], page))
        if len(self.heap) > 4 * self.lists.count[WANTED] + 1024:
            self._compact()

    def reranked(self, keys: Iterable[BlockHash]) -> None:
        """The first tickets of `keys` changed: re-rank their set-aside pages in every group. One nobody wants
        any more ranks `UNWANTED`: it goes before every listed page (it would have gone already). Nothing to do
        while no page is set aside."""
        if not self.lists.count[WANTED]:
            return
        where = self.lists.where
        for key in keys:
            for cache in self.caches:
                page = cache.get(key)
                if page is not None and where[page] == WANTED:
                    self._push(page)
                    self.released = self.released or key not in self.tickets

    def take(self, n: int) -> list[int]:
        """Unlink and return `n` free cached pages in `next_victim`'s order, for a policy not asked page by page
        (`EvictionPolicy.page_by_page` False): set-aside pages nobody wants any more, then the heads of
        probation and of the LRU list, setting aside each wanted page they pass, then set-aside wanted pages.
        The caller makes sure there are `n` (the pool's free count)."""
        self.flush()
        lists = self.lists
        pages: list[int] = []
        if self.released:
            while len(pages) < n and (page := self.victim(unwanted_only=True)) >= 0:
                lists.unlink(page)
                pages.append(page)
        for which in (PROBATION, LRU):
            if len(pages) < n and lists.count[which]:
                taken, passed = lists.take_head_unless(which, n - len(pages), self.hashes, self.tickets)
                pages += taken
                if passed:
                    self._set_aside_heads(passed, which)
        if len(pages) < n:
            self._take_aside(pages, n)
        return pages

    def _take_aside(self, pages: list[int], n: int) -> None:
        """Unlink set-aside pages in `victim`'s order onto `pages` until it holds `n` (they exist: `take`)."""
        heap, lists, sequence, hashes, tickets = self.heap, self.lists, self.sequence, self.hashes, self.tickets
        where, prv, nxt, pop = lists.where, lists.prev, lists.next, heapq.heappop
        left = taken = n - len(pages)
        while left:  # (inlined `victim`, `rank` and `unlink`: this runs once per wanted page evicted)
            rank, seq, page = pop(heap)
            if where[page] != WANTED or sequence[page] != seq:
                continue  # (stale: the page left, or it was set aside again since)
            wanting = tickets.get(hashes[page])  # type: ignore[arg-type]
            if rank != (UNWANTED if wanting is None else -(wanting[0] if isinstance(wanting, deque) else wanting)):
                continue  # (re-ranked since)
            before, after = prv[page], nxt[page]
            nxt[before] = after
            prv[after] = before
            where[page] = NONE
            pages.append(page)
            left -= 1
        lists.count[WANTED] -= taken

    def victim(self, unwanted_only: bool = False) -> int:
        """The set-aside page to evict next: lowest rank (`UNWANTED`, then the latest first ticket), then the
        earliest set aside; -1 when none is left (`unwanted_only`: when the next one is still wanted)."""
        heap, where, sequence, hashes = self.heap, self.lists.where, self.sequence, self.hashes
        while heap:
            rank, seq, page = heap[0]
            if where[page] != WANTED or sequence[page] != seq or rank != self.rank(hashes[page]):
                heapq.heappop(heap)  # (stale: the page left, or it was re-ranked since)
                continue
            if unwanted_only and rank != UNWANTED:
                self.released = False  # (the lowest live rank is a want: no page nobody wants is set aside)
                return -1
            heapq.heappop(heap)
            return page
        self.released = False
        return -1

    def restore_all(self, list_for: Callable[[int], int]) -> None:
        """Put every set-aside page back at the head of its list, oldest first (a keyed order takes over)."""
        lists, seq = self.lists, self.sequence
        for page in sorted(lists.pages(WANTED), key=lambda p: -seq[p]):
            lists.unlink(page)
            lists.prepend(page, list_for(page))
        self.heap, self.released = [], False

    def ordered(self, in_lists: Iterable[int]) -> tuple[list[int], list[int]]:
        """(set-aside pages nobody wants, then the wanted free pages) in eviction order. Wanted pages still
        `in_lists` (in list order) rank after the set-aside ones of their ticket: eviction sets them aside
        later."""
        self.flush()
        hashes, seq = self.hashes, self.sequence
        aside = [((self.rank(hashes[p]), seq[p]), p) for p in self.lists.pages(WANTED)]
        later = (p for p in in_lists if hashes[p] in self.tickets)
        aside += [((self.rank(hashes[p]), self.next_sequence + i), p) for i, p in enumerate(later)]
        done = [(key, p) for key, p in sorted(aside)]
        return [p for key, p in done if key[0] == UNWANTED], [p for key, p in done if key[0] != UNWANTED]

    def _compact(self) -> None:
        where, sequence, hashes = self.lists.where, self.sequence, self.hashes
        self.heap = [e for e in self.heap if where[e[2]] == WANTED and sequence[e[2]] == e[1]
                     and e[0] == self.rank(hashes[e[2]])]  # fmt: skip
        heapq.heapify(self.heap)

    def check(self, keyed: bool) -> None:
        """`IntegrityError` unless every set-aside page has a live heap entry of its current rank, and no page
        is set aside under a keyed order."""
        aside = list(self.lists.pages(WANTED))
        require(not (keyed and aside), f"pages set aside under a keyed order: {aside[:8]}")
        live = {(e[2], e[0]) for e in self.heap if self.sequence[e[2]] == e[1]}
        for page in aside:
            rank = self.rank(self.hashes[page])
            require((page, rank) in live, f"set-aside page {page} has no heap entry of its rank {rank}")
