"""`LowerTier`: the contract of a tier below host memory (disk, Redis) that stores pages by content hash.

A lower tier stores each page as `offload.format` header + row bytes, under
its content hash, and checks both on the way back. A row is one writable
byte view, or a list / tuple of views (its parts, in order: an SGLang host
page's K and V halves) that the tier reads from and writes into in place. It never raises into
the caller for an I/O problem: it counts it (`stats.errors`), logs it once,
and reports a miss, so the engine recomputes instead of failing. Every read
is bounded in time. A page it cannot verify is a miss for it, counted
(`stats.refused`) and never deleted by it; only a later `store` of that page
by the same tier writes over it. Pages live in a namespace of their layout
and signing key (`format.tier_namespace`). A caller that can leave a row
unused a while longer lends it to `fetch` (``done=``), so the page is read
straight into it instead of through the tier's buffers.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from pagedkv.offload.tier_stats import TierStats

__all__ = ["Done", "LentRows", "LowerTier", "OnceLogger", "Row", "check_framed", "hand_back"]

Done = Callable[[int], None]
Row = memoryview | list[memoryview] | tuple[memoryview, ...]  # one page's bytes: one view, or its parts


def check_framed(rows: Sequence[Row], page_bytes: int) -> None:
    """ValueError unless every row is one writable, contiguous byte view of `page_bytes` (header room +
    payload), as `LowerTier.store(..., framed=True)` takes."""
    for row in rows:
        if not isinstance(row, memoryview) or row.nbytes != page_bytes or row.readonly or not row.c_contiguous:
            raise ValueError(f"a framed row must be one writable view of {page_bytes} bytes (header room + payload)")


def hand_back(done: Done | None, count: int) -> None:
    """``done(i)`` for rows 0 .. count-1: what a tier whose reads end with the call owes a caller that lent them."""
    if done is not None:
        for i in range(count):
            done(i)


class LentRows:
    """The caller's side of one `LowerTier.fetch` with lent rows: pass `done`; at the fetch's end `out()` is the set of
    rows the tier has not handed back (it still may write into them), and `late(i)` is called for each of them when
    the tier hands it back (on the tier's thread)."""

    def __init__(self, late: Done | None = None) -> None:
        self._late = late
        self._lock = threading.Lock()
        self._back: set[int] = set()
        self._over = False  # the fetch returned

    def done(self, i: int) -> None:
        with self._lock:
            if not self._over:
                self._back.add(i)
                return
        if self._late is not None:
            self._late(i)

    def out(self, total: int) -> set[int]:
        """At the fetch's end (`total` rows lent): the rows not handed back yet."""
        with self._lock:
            self._over = True
            return set(range(total)) - self._back


class OnceLogger:
    """Logs the first error of each kind at WARNING, the rest at DEBUG (errors are still counted)."""

    def __init__(self, name: str) -> None:
        self.log = logging.getLogger(f"pagedkv.offload.{name}")
        self._seen: set[str] = set()

    def error(self, kind: str, message: str) -> None:
        level = logging.DEBUG if kind in self._seen else logging.WARNING
        self._seen.add(kind)
        self.log.log(level, message)

    def recovered(self, kind: str, message: str) -> None:
        """Log a recovery once and re-arm the warning for `kind`."""
        if kind in self._seen:
            self._seen.discard(kind)
            self.log.warning(message)


class LowerTier(ABC):
    """Pages by content hash below host memory. Methods are called from one thread at a time."""

    name: str  # "disk", "redis"
    medium: str  # event medium: "DISK", "REDIS"
    stats: TierStats

    @abstractmethod
    def fetch(self, keys: Sequence[bytes], dest: Sequence[Row], done: Done | None = None) -> int:
        """Read the pages of the longest prefix of `keys` the tier holds into `dest` (one writable
        row view per key), checking header and checksum; stop at the first missing or refused page.
        Returns how many leading rows of `dest` hold valid pages.

        Without `done`, nothing writes into `dest` once this returns (a tier whose reads can outlive
        the call, the disk's, reads through its own buffers). With `done` the caller lends the rows:
        the tier may read straight into them and calls ``done(i)`` exactly once for every row i, once
        it will not write into row i any more; before returning for every row but those whose read
        the tier gave up waiting for (those are misses), which it hands back later, from its own
        thread, when the read ends. Until ``done(i)`` the caller must not reuse row i; rows past the
        returned count hold nothing valid either way."""

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the tier holds each page (no bytes read, nothing checked: a page that is there may
        still be refused by `fetch`). False for every key while the tier is unreachable."""

    def probe(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each page is there with a header that `fetch` would accept (`format.check_header`:
        layout, key, length, signed or not; the payload is not read, so its tag is not checked).
        Tiers that can read a header cheaply refuse (count, and leave in place) a page that fails;
        this default is `contains`."""
        return self.contains(keys)

    @abstractmethod
    def store(self, keys: Sequence[bytes], rows: Sequence[Row], done: Done, *, framed: bool = False) -> None:
        """Write each row under its key, in the background; pages already stored are skipped, but for a page
        this tier refused, which is written over.
        ``done(i)`` is called once row i is no longer read (written, skipped or failed).

        With ``framed=True`` each row is one writable byte view of `format.HEADER_SIZE` bytes of room
        followed by the payload: the tier writes the page's header into that room (`format.seal`, on
        its own threads) and stores the view as one buffer, so the page is never joined or copied on
        our side. The caller must not read or write the room until ``done(i)``."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every write issued so far has finished."""

    @abstractmethod
    def reset(self) -> int:
        """Delete every page this tier can enumerate and own; returns how many."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish pending writes and release threads and connections."""

    @property
    def num_pages(self) -> int:
        """Capacity in pages (0 when unknown, as for a shared server)."""
        return 0

    @property
    def num_used_pages(self) -> int:
        """Pages stored (0 when unknown)."""
        return 0
