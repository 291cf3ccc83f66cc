"""Bounded reads of the disk tier: work on reader threads that the caller waits for, at most so long without progress.

A read of a page file can block for as long as the file system wants (a dead
NFS server, a FUSE daemon that never answers). The disk tier never reads on
the caller's thread: `ReadBatch` hands the work to reader threads and waits
until it is done, or until no item finished for `timeout_s`; then the batch
is abandoned and what is not done is a miss. A reader that outlives its batch
must not write into a row the caller reuses. Two ways:

- lent rows (the caller passed `done`): a run reads straight into the row
  (one `preadv` for header and payload). It `claim`s item i before touching
  its row and `finish`es it after; `ReadBatch.hand_back` calls ``done(i)`` for
  every row once no run can write into it: at `wait`'s end for every row but
  those a run was reading when the batch was abandoned, which that run hands
  back itself when its read ends.
- rows the tier may not write late (no `done`): a run reads into its own
  scratch buffer (`CHUNK` bytes, cache resident) and copies each chunk into
  the row under its run's guard only while the batch is not abandoned, which
  `ReadBatch.wait` sets under every guard.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence

__all__ = [
    "CHUNK",
    "ReadBatch",
    "head",
    "read_all",
    "read_lent",
    "read_through",
    "readv_all",
    "scatter",
    "write_all",
    "write_file",
]

CHUNK = 256 * 1024  # bytes a reader reads into its scratch buffer at a time
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW  # a planted file or link at the name is not written


class ReadBatch:
    """`total` items worked on by `runs` reader runs. An item ends ok or not (`finish`); `stop_at_miss`: a
    miss at item i ends every run at i (`stop`). `wait` returns once every run ended, or abandons the batch
    after `timeout_s` without an item ending. With `done` (rows lent by the caller), `hand_back` then calls
    ``done(i)`` exactly once for every item: at once for those no run is reading, and from the run for an
    item it was reading when the batch was abandoned, once that read ends."""

    def __init__(self, total: int, runs: int, stop_at_miss: bool, done: Callable[[int], None] | None = None) -> None:
        self.total = total
        self.done = done
        self.busy = [-1] * runs  # the item each run is reading (claimed, not finished); -1: none
        self._late: set[int] = set()  # items a run was reading when the batch was abandoned: it hands them back
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

    def claim(self, run: int, i: int) -> bool:
        """Run `run` starts item i (it may write into its row until `finish`): False, and the run must not
        touch the row, when the item is no longer wanted (abandoned, or past a miss)."""
        with self._cond:
            if self.abandoned or i >= self.stop:
                return False
            self.busy[run] = i
            return True

    def finish(self, i: int, ok: bool, run: int = -1) -> None:
        """Item i ended (ok: its result stands, unless the batch was abandoned first). Wakes nobody: the waiter
        looks at the progress when a run ends or its stall window passes. A `run` that claimed i and outlived
        the batch hands its row back here (``done(i)``, on this thread)."""
        with self._cond:
            self._progress += 1
            if ok and not self.abandoned:
                self.ok[i] = 1
            elif not ok and self.stop_at_miss:
                self.stop = min(self.stop, i)
            late = run >= 0 and self.busy[run] == i and i in self._late
            if run >= 0 and self.busy[run] == i:
                self.busy[run] = -1
        if late and self.done is not None:
            self.done(i)

    def hand_back(self) -> None:
        """After `wait`: ``done(i)`` for every item whose row no run can write into any more (all of them, but
        for items runs were still reading in an abandoned batch: those runs call it when they end)."""
        if self.done is None:
            return
        with self._cond:
            late = set(self._late)
        for i in range(self.total):
            if i not in late:
                self.done(i)

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
                self._late = {i for i in self.busy if i >= 0}
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


def readv_all(fd: int, views: list[memoryview], offset: int = 0) -> int:
    """Read the file from `offset` into the concatenation of `views` (one preadv, resumed after a short read)
    until they are full or the file ends; returns the bytes read."""
    size = sum(len(v) for v in views)
    total = 0
    while total < size:
        n = os.preadv(fd, views if not total else _tail(views, total), offset + total)
        if not n:
            break
        total += n
    return total


def _tail(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` without their first `skip` bytes."""
    out = []
    for view in views:
        if skip >= len(view):
            skip -= len(view)
            continue
        out.append(view[skip:])
        skip = 0
    return out


def read_all(fd: int, buffer: memoryview, offset: int) -> int:
    """Read the file from `offset` into `buffer` until it is full or the file ends; returns the bytes read."""
    return readv_all(fd, [buffer], offset)


def head(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first `nbytes` of `parts`, as views."""
    out = []
    for part in parts:
        take = min(len(part), nbytes)
        out.append(part[:take])
        nbytes -= take
    return out


def read_lent(fd: int, header: memoryview, parts: list[memoryview]) -> tuple[bytes, int]:
    """A page file read straight into `header` and `parts` (a lent row), one preadv: (header, payload bytes)."""
    got = readv_all(fd, [header, *parts]) - len(header)
    return (bytes(header), got) if got >= 0 else (bytes(header[: got + len(header)]), 0)


def read_through(
    fd: int, scratch: memoryview, parts: list[memoryview], row_bytes: int, batch: ReadBatch, run: int
) -> tuple[bytes, int] | None:
    """A page file read into `scratch` (header room + a chunk) a chunk at a time, each copied into `parts` under
    run `run`'s guard while `batch` is not abandoned: (header, payload bytes), or None once it is abandoned."""
    room = len(scratch) - min(CHUNK, row_bytes)
    n = read_all(fd, scratch, 0)  # the header and a first chunk
    header, chunk, got = bytes(scratch[: min(n, room)]), scratch[room:n], 0
    while chunk:
        with batch.guards[run]:
            if batch.abandoned:
                return None
            scatter(parts, got, chunk)
        got += len(chunk)
        if got == row_bytes:
            break
        n = read_all(fd, scratch[room : room + min(CHUNK, row_bytes - got)], room + got)
        chunk = scratch[room : room + n]
    return header, got


def write_file(path: str, tmp: str, buffers: list[bytes | memoryview]) -> None:
    """`buffers` written to `tmp` with one write(v) (created: never through a link or a planted file) and renamed
    to `path`; the bucket directory is made when missing, and never written through when it is a link."""
    if os.path.islink(os.path.dirname(path)):
        raise OSError(errno.ELOOP, "the bucket directory is a symbolic link; not written through it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of this thread's interrupted write (or something planted there)
    try:
        fd = os.open(tmp, _CREATE, 0o644)
    except FileNotFoundError:  # the first page of this bucket (or its directory was removed)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, _CREATE, 0o644)
    try:
        write_all(fd, buffers)  # one write(v) for header and row
    finally:
        os.close(fd)
    os.replace(tmp, path)  # (over a page this tier refused, too)
