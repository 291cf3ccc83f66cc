"""`DiskIndex`: the pages of one disk tier directory in LRU order, one index for every process writing it.

    <directory>/pages.journal    header (magic, generation), then 34-byte records: op, key length, key

The size cap of a directory is the directory's, whatever the number of
processes writing it. Each process keeps the index in memory and brings it
up to date from the journal, under an exclusive `flock` of that file, before
it decides anything that counts pages (which pages to evict, whether a page
is there), and appends what it did. Records:

    +  reserved: a page is being written (counted against the cap, never chosen as a victim)
    =  stored: the page's file is in place (the most recently used)
    -  removed (evicted, or its write failed)
    ~  used (read): the most recently used

A writer reserves its page before writing it (evicting the least recently
used stored pages until the reserved and stored ones fit), and marks it stored
after the rename (evicting again until the stored ones fit), so pages written
side by side never leave more than the cap once their writes end. The journal
is compacted (rewritten to one record per page and renamed into place, with a
new generation) once it holds many more records than pages; a process that
sees another generation or another file reloads it.

Single-process cost: one `flock`, one `stat` and a short `pread` / `pwrite` per
reserve, store and `flush` of reads (reads only note their pages in memory),
and a writer reserves (`reserve_all`) and records (`stored_all`) a group of
pages with one each;
never a directory scan (only at start, `reconcile`). A journal that cannot be used (a link or a FIFO planted at its
name, no permission) is logged once and the index is this process's alone, as
if it were the only writer. A lock held past `timeout_s` (a stopped or
hostile process) fails the operation with `TimeoutError`: the writer counts
it as an error and skips that page; noted reads wait for the next lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = ["JOURNAL", "DiskIndex", "scan"]

JOURNAL = "pages.journal"
MAGIC = b"PKVJ\x00\x00\x00\x01"
_HEADER = struct.Struct("<8sQ")  # magic, generation
RECORD = 34  # op, key length, key (zero padded to 32)
RESERVED, STORED, REMOVED, USED = b"+", b"=", b"-", b"~"
MAX_PENDING_USES = 65536  # reads remembered while the lock is busy (older ones are dropped: only LRU order)
_OPEN = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | os.O_CLOEXEC


def _record(op: bytes, key: bytes) -> bytes:
    return op + bytes([len(key)]) + key.ljust(32, b"\x00")


class DiskIndex:
    """Pages of `directory` (content hash -> stored or only reserved), oldest first, at most `capacity`.

    Thread-safe. Every method that counts pages syncs with the journal under its lock first. `on_error(kind,
    message)` is told (once per kind is enough) when the journal cannot be used; the index then keeps working
    for this process alone."""

    def __init__(self, directory: str, capacity: int, timeout_s: float, on_error: Callable[[str, str], None]) -> None:
        self.path = os.path.join(directory, JOURNAL)
        self.capacity = capacity
        self.timeout_s = timeout_s
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pages: OrderedDict[bytes, bool] = OrderedDict()  # key -> stored (False: reserved), oldest first
        self._reserved = 0  # entries of _pages that are only reserved
        self._fd: int | None = None
        self._dirty = False  # records of this index are missing from the journal (a write failed)
        self._shared = True  # False once the journal proved unusable: this process's index alone
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the journal the index reflects
        self._generation = -1
        self._pos = 0  # bytes of the journal applied
        self._uses: OrderedDict[bytes, None] = OrderedDict()  # reads not yet recorded (the lock was busy)
        self._uses_lock = threading.Lock()
        self._out: list[bytes] = []  # records of the operation under the lock, written when it ends (one pwrite)

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: object) -> bool:
        return key in self._pages

    def is_stored(self, key: bytes) -> bool:
        """The page is indexed as written (not only reserved). As of the last sync."""
        return self._pages.get(key, False)

    # ----------------------------------------------------------------- changes
    def reconcile(self, found: Iterable[tuple[float, bytes]]) -> None:
        """At start: the index becomes the pages whose files are there. `found` is (mtime, key) of every page
        file of the directory (a scan); journal entries without a file are dropped (a writer still writing
        one marks it stored again when done), files the journal lacks are added as the least recently used
        (by mtime); the journal is rewritten. Without a usable journal: the scan, by mtime."""
        present = sorted(found)
        keys = {key for _, key in present}
        with self._locked() as shared:
            known = [key for key in self._pages if key in keys] if shared else []
            fresh = [key for _, key in present if key not in self._pages] if shared else [k for _, k in present]
            self._pages, self._reserved = OrderedDict((key, True) for key in fresh + known), 0
            if shared:
                self._compact()

    def reserve(self, key: bytes, present: Callable[[], bool] | None = None) -> list[bytes] | None:
        """Count `key` as being written (the most recently used; a stored page stays stored: it is being
        rewritten), and remove the least recently used stored pages until reserved and stored ones fit the cap.
        Returns those victims (the caller deletes their files); None, changing nothing, when `key` is stored
        and `present()` (its file is there: nothing to write). TimeoutError when the lock stays busy."""
        with self._locked():
            if present is not None and self._pages.get(key, False) and present():
                return None
            self._put(key, self._pages.get(key, False))
            return self._trim(len(self._pages))

    def reserve_all(
        self, keys: Sequence[bytes], present: Callable[[bytes], bool] | None = None
    ) -> tuple[list[bytes], list[bytes]]:
        """`reserve` for each of `keys` (distinct), in order, under one lock and with one journal write: returns
        (the keys reserved, victims). A key that is stored and `present(key)` is left out (nothing to write).
        TimeoutError, changing nothing, when the lock stays busy."""
        with self._locked():
            todo = [k for k in keys if present is None or not (self._pages.get(k, False) and present(k))]
            for key in todo:
                self._put(key, self._pages.get(key, False))
            return todo, self._trim(len(self._pages))

    def stored_all(self, keys: Sequence[bytes]) -> list[bytes]:
        """`stored` for each of `keys`, in order, under one lock and with one journal write; returns the victims
        (evicted once all of them count). TimeoutError, changing nothing, when the lock stays busy."""
        with self._locked():
            for key in keys:
                self._put(key, True)
            return self._trim(len(self._pages) - self._reserved)

    def stored(self, key: bytes) -> list[bytes]:
        """`key`'s file is in place: mark it stored (again, if another process removed it meanwhile), the most
        recently used, and remove the least recently used stored pages until the stored ones fit. Returns
        the victims. TimeoutError when the lock stays busy."""
        with self._locked():
            self._put(key, True)
            return self._trim(len(self._pages) - self._reserved)

    def abandon(self, key: bytes, exists: Callable[[], bool]) -> None:
        """The write of `key` failed: forget the reservation unless the page is stored (by another process)
        or `exists()` (its file is there all the same). Best effort: a busy lock leaves it reserved."""
        with contextlib.suppress(OSError), self._locked():
            if key in self._pages and not self._pages[key] and not exists():
                self._drop(key)
                self._append([_record(REMOVED, key)])

    def used(self, keys: Iterable[bytes]) -> int:
        """These pages were read: they become the most recently used (a page not indexed, whose file was there,
        is added as stored) at the next call that takes the lock (`flush`, a write). Touches no file; returns
        how many reads are noted and not recorded yet."""
        with self._uses_lock:
            for key in keys:
                self._uses[key] = None
                self._uses.move_to_end(key)
            while len(self._uses) > MAX_PENDING_USES:
                self._uses.popitem(last=False)
            return len(self._uses)

    def flush(self) -> None:
        """Record the reads `used` noted. TimeoutError when the lock stays busy (they stay noted)."""
        with self._locked():
            pass

    def remove_all(self) -> list[bytes]:
        """Forget every page of the directory (every process's); returns their keys (the caller deletes the
        files). TimeoutError when the lock stays busy."""
        with self._locked() as shared:
            keys = list(self._pages)
            self._pages.clear()
            self._reserved = 0
            if shared:
                self._compact()
            return keys

    # ----------------------------------------------------------------- internals
    def _put(self, key: bytes, stored: bool) -> None:
        self._set(key, stored)
        self._append([_record(STORED if stored else RESERVED, key)])

    def _set(self, key: bytes, stored: bool) -> None:
        """`key` is stored (or reserved), the most recently used."""
        self._reserved += (not stored) - (self._pages.get(key, True) is False)
        self._pages[key] = stored
        self._pages.move_to_end(key)

    def _drop(self, key: bytes) -> None:
        if self._pages.pop(key, True) is False:
            self._reserved -= 1

    def _trim(self, count: int) -> list[bytes]:
        """Remove the oldest stored pages while `count` (pages that count) is over the cap."""
        over = count - self.capacity
        victims = []
        if over > 0:
            for key, stored in self._pages.items():  # O(victims + reserved ones before them)
                if stored:
                    victims.append(key)
                    if len(victims) == over:
                        break
            for key in victims:
                del self._pages[key]
            self._append([_record(REMOVED, key) for key in victims])
        return victims

    @contextlib.contextmanager
    def _locked(self, wait: bool = True) -> Iterator[bool]:
        """Hold this process's lock and the journal's, with the index synced and reads recorded; yields whether
        the index is shared (False: the journal is unusable). TimeoutError when either lock stays busy past
        `timeout_s` (at once with ``wait=False``)."""
        if not self._lock.acquire(blocking=wait, timeout=self.timeout_s if wait else -1):
            raise TimeoutError(f"the disk tier index of {self.path} is busy")
        try:
            fd = self._acquire(wait)
            try:
                if fd is not None:
                    self._sync(fd)
                    if self._dirty:  # a record this process could not write: the journal is rewritten
                        with contextlib.suppress(OSError):
                            self._compact()
                with self._uses_lock:
                    uses, self._uses = list(self._uses), OrderedDict()
                records = []
                for key in uses:
                    known = key in self._pages
                    self._set(key, self._pages.get(key, True))
                    records.append(_record(USED if known else STORED, key))
                self._append(records)
                yield fd is not None
            finally:
                self._write_out()
                if fd is not None and self._fd is not None:  # (a compaction moved the lock to the new file)
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _acquire(self, wait: bool) -> int | None:
        """The journal's fd, locked, and the file now at its name (reopened when it was replaced or deleted);
        None when the journal is unusable."""
        deadline = time.monotonic() + (self.timeout_s if wait else 0.0)
        while self._shared:
            fd = self._open()
            if fd is None:
                return None
            delay = 0.0002
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"{self.path} stayed locked for {self.timeout_s}s") from None
                    time.sleep(delay)
                    delay = min(2 * delay, 0.005)
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except OSError:
                now = None
            mine = os.fstat(fd)
            if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)  # compacted (renamed over) or deleted meanwhile: the new file
            self._close()
        return None

    def _open(self) -> int | None:
        if self._fd is not None:
            return self._fd
        try:
            try:
                fd = os.open(self.path, _OPEN, 0o644)
            except FileNotFoundError:  # the directory was removed (an operator, a wipe): made again
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                fd = os.open(self.path, _OPEN, 0o644)
        except OSError as exc:
            self._unusable(f"cannot be opened ({exc})")
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            self._unusable("is not a regular file")
            return None
        self._fd = fd
        return fd

    def _unusable(self, why: str) -> None:
        self._shared = False
        self._on_error("journal", f"disk tier: the page journal {self.path} {why}; the size cap is kept by this "
                                  "process alone")  # fmt: skip

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _sync(self, fd: int) -> None:
        """Apply the journal's records this process has not seen (all of them after a compaction, or for
        another file); a journal without a valid header (new, or damaged) is started over from this index."""
        info = os.fstat(fd)
        header = os.pread(fd, _HEADER.size, 0)
        magic, generation = _HEADER.unpack(header) if len(header) == _HEADER.size else (b"", 0)
        if magic != MAGIC:
            self._file, self._generation = (info.st_dev, info.st_ino), -1
            self._compact()
            return
        if (info.st_dev, info.st_ino) != self._file or generation != self._generation:
            self._pages.clear()
            self._reserved = 0
            self._file, self._generation, self._pos = (info.st_dev, info.st_ino), generation, _HEADER.size
        end = info.st_size - (info.st_size - _HEADER.size) % RECORD  # a torn last record is not applied
        if end - self._pos > RECORD * 16 * (self.capacity + 65536):  # far more than any writer leaves behind
            self._on_error("journal-size", f"disk tier: the page journal {self.path} holds {info.st_size} bytes, "
                                           "far more than its pages need; it is started over from this process's "
                                           "index")  # fmt: skip
            self._compact()
            return
        while self._pos < end:
            data = os.pread(fd, min(end - self._pos, RECORD * 65536), self._pos)
            if not data:
                break
            usable = len(data) - len(data) % RECORD
            self._apply(memoryview(data)[:usable])
            self._pos += usable

    def _apply(self, data: memoryview) -> None:
        pages = self._pages
        for at in range(0, len(data), RECORD):
            op, size = data[at : at + 1].tobytes(), data[at + 1]
            if not 1 <= size <= 32:
                continue  # not a record this index writes: skipped
            key = data[at + 2 : at + 2 + size].tobytes()
            if op == REMOVED:
                self._drop(key)
            elif op == STORED or op == RESERVED:  # (a stored page reserved again is being rewritten: stored)
                self._set(key, op == STORED or pages.get(key, False))
            elif op == USED and key in pages:
                pages.move_to_end(key)

    def _append(self, records: list[bytes]) -> None:
        """Queue `records` for the journal: written in one go when the lock is released (`_write_out`)."""
        if self._shared:
            self._out.extend(records)

    def _write_out(self) -> None:
        """Write the queued records at the end of what was applied (over a torn record, if any); compact a long
        journal. A write that fails (a full disk) is logged, and the journal is rewritten from this index at the
        next lock that can: the index itself stays right for this process."""
        records, self._out = self._out, []
        fd = self._fd if self._shared else None
        if fd is None or not records:
            return
        data = b"".join(records)
        try:
            written = os.pwrite(fd, data, self._pos)
        except OSError as exc:
            written, why = -1, str(exc)
        else:
            why = f"{written} of {len(data)} bytes written"
        if written != len(data):
            self._dirty = True
            self._on_error("journal-write", f"disk tier: writing the page journal {self.path} failed ({why}); "
                                            "it is rewritten when it can be")  # fmt: skip
            return
        self._pos += len(data)
        if (self._pos - _HEADER.size) // RECORD > 2 * len(self._pages) + 4096:
            with contextlib.suppress(OSError):  # (a failed compaction leaves the journal as it is: still valid)
                self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as one record per page with a new generation, renamed into place (a crash
        leaves the old journal or the new one, never a mix). The new file is locked before it gets the name,
        so the caller's lock carries over to it; the old one is closed (its lock released)."""
        if not self._shared:
            return
        generation = max(self._generation, 0) + 1
        data = _HEADER.pack(MAGIC, generation) + b"".join(
            _record(STORED if stored else RESERVED, key) for key, stored in self._pages.items())  # fmt: skip
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, _OPEN | os.O_EXCL, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has it open yet
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "the new journal was written short")
            os.replace(tmp, self.path)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        info = os.fstat(fd)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        self._file, self._generation, self._pos = (info.st_dev, info.st_ino), generation, len(data)
        self._dirty = False
        self._out.clear()  # (the new journal holds every page as the index has it)

    def close(self) -> None:
        """Release the journal's file descriptor."""
        with self._lock:
            self._close()


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def scan(directory: str, file_bytes: int) -> list[tuple[float, bytes]]:
    """(mtime, key) of every page file of `directory` that is `file_bytes` long, for `DiskIndex.reconcile`; removes
    what interrupted writes left. Only names a disk tier writes are touched: two-hex-digit buckets, ``<hex>.page``
    pages and ``<hex>.<thread>.tmp`` leftovers, and the journal's temporary files (a minute old); symbolic links
    (to a directory or file elsewhere) are neither followed, indexed nor deleted, so nothing outside the directory
    is ever read or removed."""
    found: list[tuple[float, bytes]] = []
    for entry in _entries(directory):  # a journal compaction's temporary file, left by a crash
        if (
            entry.name.startswith(f"{JOURNAL}.")
            and entry.name.endswith(".tmp")
            and entry.is_file(follow_symlinks=False)
        ):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat(follow_symlinks=False).st_mtime > 60:
                    os.unlink(entry.path)
    for bucket in _entries(directory):
        if len(bucket.name) != 2 or not _is_hex(bucket.name) or not bucket.is_dir(follow_symlinks=False):
            continue
        for entry in _entries(bucket.path):
            stem, _, suffix = entry.name.partition(".")
            if not _is_hex(stem) or not entry.is_file(follow_symlinks=False):
                continue
            if suffix == "page":
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if info.st_size == file_bytes:
                        found.append((info.st_mtime, bytes.fromhex(stem)))
            elif suffix.endswith(".tmp") and suffix[:-4].isdigit():
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # an interrupted write's temporary file
    return found
