"""Intrusive doubly linked lists over page ids: the pool's free lists of cached pages.

Each page id in ``[0, n)`` is in at most one list. Links live in two int32
arrays with one sentinel slot per list after the pages, so unlinking or
appending a page is O(1) and allocates nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

__all__ = ["FreeLists", "NONE", "LRU", "PROTECTED", "PROBATION"]

NONE, LRU, PROTECTED, PROBATION = 0, 1, 2, 3  # list ids (NONE: in no list)


class FreeLists:
    """Three lists (LRU, PROTECTED, PROBATION) of pages in ``[0, n)``, each head = oldest."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = array("i", [0]) * (n + 4)
        self.next = array("i", [0]) * (n + 4)
        self.sentinel = (0, n + 1, n + 2, n + 3)  # indexed by list id (slot n is the null page's)
        for s in self.sentinel[1:]:
            self.prev[s] = self.next[s] = s  # empty circular lists
        self.where = bytearray(n)  # the list each page is in
        self.count = [0, 0, 0, 0]  # pages per list

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
