"""Bounded reads of the disk tier: work on reader threads that the caller waits for, at most so long without progress.

A read of a page file can block for as long as the file system wants (a dead
NFS server, a FUSE daemon that never answers). The disk tier never reads on
the caller's thread: `ReadBatch` hands the work to reader threads and waits
until it is done, or until no item finished for `timeout_s`; then the batch
is abandoned and what is not done is a miss. A reader that outlives its batch
must not write into the caller's rows any more (they may hold other pages by
then): readers read into their own scratch buffer (`CHUNK` bytes, cache
resident) and copy each chunk into the row under their run's guard only while
the batch is not abandoned, which `ReadBatch.wait` sets under every guard.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence

__all__ = ["CHUNK", "ReadBatch", "head", "read_all", "scatter", "write_all"]

CHUNK = 256 * 1024  # bytes a reader reads into its scratch buffer at a time


class ReadBatch:
    """`total` items worked on by `runs` reader runs. An item ends ok or not (`finish`); `stop_at_miss`: a
    miss at item i ends every run at i (`stop`). `wait` returns once every run ended, or abandons the batch
    after `timeout_s` without an item ending."""

    def __init__(self, total: int, runs: int, stop_at_miss: bool) -> None:
        self.total = total
        self.runs = runs
        self.stop_at_miss = stop_at_miss
        self.stop = total  # the lowest item that missed (stop_at_miss)
        self.ok = bytearray(total)
        self.abandoned = False
        self.guards = [threading.Lock() for _ in range(runs)]  # held by run r while it writes the caller's rows
        self._cond = threading.Condition()
        self._ended = 0  # runs that returned
        self._progress = 0  # items that ended

    def live(self, i: int) -> bool:
        """Item i is still wanted (not abandoned, not past a miss)."""
        return not self.abandoned and i < self.stop

    def finish(self, i: int, ok: bool) -> None:
        """Item i ended (ok: its result stands, unless the batch was abandoned first). Wakes nobody: the waiter
        looks at the progress when a run ends or its stall window passes."""
        with self._cond:
            self._progress += 1
            if ok and not self.abandoned:
                self.ok[i] = 1
            elif not ok and self.stop_at_miss:
                self.stop = min(self.stop, i)

    def run_ended(self) -> None:
        with self._cond:
            self._ended += 1
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait for every run; False when the batch was abandoned (no item ended for `timeout_s`). After it
        returns no run writes into the caller's rows and `ok` no longer changes."""
        with self._cond:
            seen, deadline = -1, 0.0  # abandoned once a whole window of `timeout_s` passes without progress
            while self._ended < self.runs:
                now = time.monotonic()
                if self._progress != seen:
                    seen, deadline = self._progress, now + timeout_s
                elif now >= deadline:
                    break
                self._cond.wait(deadline - now)
            if self._ended == self.runs:
                return True
        for guard in self.guards:  # no run is between its check and its copy once we hold every guard
            guard.acquire()
        try:
            with self._cond:
                self.abandoned = True
        finally:
            for guard in self.guards:
                guard.release()
        return False

    def prefix(self) -> int:
        """How many leading items ended ok."""
        with self._cond:
            count = self.ok.find(0)
            return self.total if count < 0 else min(count, self.stop)

    def results(self) -> list[bool]:
        with self._cond:
            return [bool(x) for x in self.ok]


def scatter(parts: Sequence[memoryview], at: int, data: memoryview) -> None:
    """Copy `data` into the concatenation of `parts` at byte `at`."""
    if len(parts) == 1:
        parts[0][at : at + len(data)] = data
        return
    for part in parts:
        size = len(part)
        if at >= size:
            at -= size
            continue
        take = min(size - at, len(data))
        part[at : at + take] = data[:take]
        data = data[take:]
        at = 0
        if not data:
            return


def write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    """Write all of `parts` at the file's position (writev; a short write is resumed, and the
    call after one that could not write everything raises, e.g. EFBIG or ENOSPC)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        if not n:
            raise OSError(errno.EIO, "write returned 0")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def read_all(fd: int, buffer: memoryview, offset: int) -> int:
    """Read the file from `offset` into `buffer` until it is full or the file ends; returns the bytes read."""
    total = 0
    while total < len(buffer):
        n = os.preadv(fd, [buffer[total:]], offset + total)
        if not n:
            break
        total += n
    return total


def head(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first `nbytes` of `parts`, as views."""
    out = []
    for part in parts:
        take = min(len(part), nbytes)
        out.append(part[:take])
        nbytes -= take
    return out
