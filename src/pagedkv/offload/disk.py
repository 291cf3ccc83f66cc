"""`DiskTier`: pages as files in a bucketed directory, LRU under a size cap, warm across restarts.

    <disk_offload_dir>/<layout fingerprint>/<first hash byte>/<content hash>.page

One file per page (header + row, `offload.format`), written to a temporary
name and renamed into place, so a reader never sees a torn page: a crash
leaves either the old state or a complete file (and a file the kernel lost
after a power cut fails its checksum and is refused). Why files, not one
preallocated file: rename makes each page atomic without a journal, another
process (or a restarted one) finds a page by its name alone, deleting frees
disk space at once, and pages of another model or layout live in their own
subdirectory instead of corrupting a shared slot map. The index is rebuilt
at start by listing the directory (LRU order = file modification time).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedkv.core.events import BlockRemoved, EventSink
from pagedkv.core.tier_stats import TierStats
from pagedkv.offload.format import (
    HEADER_SIZE,
    PageHeader,
    check_header,
    check_page,
    decode_header,
    encode_header,
    payload_parts,
    seal,
)
from pagedkv.offload.tier import Done, LowerTier, OnceLogger, Row, check_framed

__all__ = ["DiskTier"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW  # a planted file or link at the name is not written
_READ = os.O_RDONLY | _NOFOLLOW  # a page that is a symbolic link is refused (ELOOP), never followed


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


class DiskTier(LowerTier):
    """Pages of one layout (`fingerprint`) under `directory`, at most `max_bytes` of them."""

    name = "disk"
    medium = "DISK"

    def __init__(
        self, directory: str | os.PathLike[str], row_bytes: int, max_bytes: int, fingerprint: bytes, hash_algo: str,
        *, threads: int = 4, emit: EventSink | None = None, mac_key: bytes | None = None,
    ) -> None:  # fmt: skip
        self.root = Path(directory) / fingerprint.hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self.row_bytes = row_bytes
        self.file_bytes = HEADER_SIZE + row_bytes
        self.capacity = max(1, max_bytes // self.file_bytes)
        self.fingerprint = fingerprint
        self.hash_algo = hash_algo
        self.mac_key = mac_key  # sign every write, require a signature on every read
        self.emit = emit
        self.stats = TierStats("disk")
        self._log = OnceLogger("disk")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # pages on disk, oldest first
        self._writing: set[bytes] = set()
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-disk")
        self._inflight: set[object] = set()
        self._root = str(self.root)
        self._scan()

    # ----------------------------------------------------------------- layout
    def path(self, key: bytes) -> Path:
        """Where page `key` lives."""
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        """`path(key)` as a string (no pathlib on the hot paths)."""
        return f"{self._root}/{key[0]:02x}/{key.hex()}.page"

    def _scan(self) -> None:
        """Rebuild the index from the files a previous process left (and drop unfinished ones).

        Only names this tier writes are touched: two-hex-digit buckets, ``<hex>.page`` pages and
        ``<hex>.<thread>.tmp`` leftovers; symbolic links (to a directory or file elsewhere) are
        neither followed, indexed nor deleted, so nothing outside the directory is ever read or removed.
        """
        found: list[tuple[float, bytes]] = []
        for bucket in _entries(self._root):
            if len(bucket.name) != 2 or not _is_hex(bucket.name) or not bucket.is_dir(follow_symlinks=False):
                continue
            for entry in _entries(bucket.path):
                stem, _, suffix = entry.name.partition(".")
                if not _is_hex(stem) or not entry.is_file(follow_symlinks=False):
                    continue
                if suffix == "page":
                    with contextlib.suppress(OSError):
                        stat = entry.stat(follow_symlinks=False)
                        if stat.st_size == self.file_bytes:
                            found.append((stat.st_mtime, bytes.fromhex(stem)))
                elif suffix.endswith(".tmp") and suffix[:-4].isdigit():
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)  # an interrupted write's temporary file
        for _, key in sorted(found):
            self._index[key] = None

    @property
    def num_pages(self) -> int:
        return self.capacity

    @property
    def num_used_pages(self) -> int:
        return len(self._index)

    # ----------------------------------------------------------------- reads
    def fetch(self, keys: Sequence[bytes], dest: Sequence[Row]) -> int:
        """Up to `threads` readers (the calling thread one of them) take every `threads`-th page, in
        order; a miss or refusal at page i stops every reader at i (pages before it are all read)."""
        total = len(keys)
        if total != len(dest):
            raise ValueError(f"{len(keys)} keys but {len(dest)} destination rows")
        stop = [total]  # the lowest page index that failed

        def reader(first: int, step: int) -> None:
            for i in range(first, total, step):
                if i >= stop[0]:
                    return
                if not self._read(keys[i], dest[i]):
                    with self._lock:
                        stop[0] = min(stop[0], i)
                    return

        step = max(1, min(self._threads, total))
        futures = [(first, self._pool.submit(reader, first, step)) for first in range(1, step)]
        try:
            reader(0, step)
        finally:
            for first, future in futures:  # nothing may write into `dest` after we return
                if future.cancel():  # not started (the pool is busy writing): read its pages here
                    reader(first, step)
                else:
                    future.result()
        count = stop[0]
        with self._lock:
            for key in keys[:count]:
                if key in self._index:
                    self._index.move_to_end(key)
                else:
                    self._index[key] = None  # written by another process sharing the directory
        return count

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """One `stat` per key (another process sharing the directory may have written it)."""
        return [os.path.isfile(self._file(key)) for key in keys]

    def probe(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: the file is there, its size is one page and its header passes `check_header`; a
        page that fails is refused (counted, logged once, deleted). One open and a 112-byte read each."""
        found = []
        for key in keys:
            path = self._file(key)
            try:
                fd = os.open(path, _READ)
            except FileNotFoundError:
                found.append(False)
                continue
            except OSError as exc:
                found.append(False if exc.errno != errno.ELOOP else self._refuse(key, path, "a symbolic link"))
                continue
            try:
                raw, size = os.pread(fd, HEADER_SIZE, 0), os.fstat(fd).st_size
            except OSError as exc:
                found.append(self._read_failed(path, exc))
                continue
            finally:
                os.close(fd)
            reason = check_header(decode_header(raw), key, self.fingerprint, self.hash_algo, self.row_bytes,
                                  self.mac_key, size)  # fmt: skip
            found.append(True if reason is None else self._refuse(key, path, reason))
        return found

    def _refuse(self, key: bytes, path: str, reason: str) -> bool:
        """Count, log (once) and delete a refused page; False."""
        self.stats.add(refused=1)
        self._log.error("refused", f"disk tier: refused {path}: {reason}; the page is recomputed")
        self._delete([key])
        return False

    def _read(self, key: bytes, row: Row) -> bool:
        parts = payload_parts(row)
        path = self._file(key)
        header = bytearray(HEADER_SIZE)
        try:
            fd = os.open(path, _READ)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(key, None)  # deleted behind the index: forget it, so it is written again
            return False
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                return self._read_failed(path, exc)
            decoded, got = None, 0  # a symbolic link planted at a page's name: refused and removed below
        else:
            decoded, got = self._read_fd(fd, header, parts)
        payload = parts if got == self.row_bytes else _head(parts, got)
        reason = check_page(decoded, payload, key, self.fingerprint, self.hash_algo, self.row_bytes, self.mac_key)
        if reason is None and got == self.row_bytes:
            return True
        return self._refuse(key, path, reason or "short file")

    def _read_fd(self, fd: int, header: bytearray, parts: list[memoryview]) -> tuple[PageHeader | None, int]:
        """(header, payload bytes read) of an open page file; closes `fd`."""
        try:
            got = _read_all(fd, [header, *parts]) - HEADER_SIZE  # one preadv for header and row
        except OSError as exc:
            self.stats.add(errors=1)
            self._log.error("read", f"disk tier: reading a page failed ({exc}); the page is recomputed")
            return None, 0
        finally:
            os.close(fd)
        return (decode_header(memoryview(header)) if got >= 0 else None), max(0, got)

    def _read_failed(self, path: str, exc: OSError) -> bool:
        self.stats.add(errors=1)
        self._log.error("read", f"disk tier: reading {path} failed ({exc}); the page is recomputed")
        return False

    # ----------------------------------------------------------------- writes
    def store(self, keys: Sequence[bytes], rows: Sequence[Row], done: Done, *, framed: bool = False) -> None:
        """The pages not stored nor being written go to up to `threads` jobs (every `threads`-th page
        each): one task per job, not per page, so small pages do not pay a thread handoff each. A
        framed row is sealed in place and written with one write; another row is written as header
        and parts with one writev."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        if framed:
            check_framed(rows, self.file_bytes)
        todo: list[int] = []
        skipped: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._index or key in self._writing:
                    skipped.append(i)
                else:
                    self._writing.add(key)
                    todo.append(i)
        gone = [i for i in skipped if keys[i] in self._index and not os.path.exists(self._file(keys[i]))]
        with self._lock:  # files deleted behind the index (an operator, a peer's cap, a lost file): rewrite
            # (index values are None: pop gives None once per key still indexed, then the default 0)
            gone = [i for i in gone if keys[i] not in self._writing and self._index.pop(keys[i], 0) is None]
            self._writing.update(keys[i] for i in gone)
        todo = sorted(todo + gone) if gone else todo
        for i in sorted(set(skipped) - set(gone)):
            done(i)
        jobs = min(self._threads, len(todo))
        for first in range(jobs):
            index = todo[first::jobs]
            future = self._pool.submit(self._write_job, [keys[i] for i in index], [rows[i] for i in index], index, done,
                                       framed)  # fmt: skip
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)

    def _write_job(self, keys: list[bytes], rows: list[Row], index: list[int], done: Done, framed: bool) -> None:
        for key, row, i in zip(keys, rows, index, strict=True):
            self._write(key, row, i, done, framed)

    def _write(self, key: bytes, row: Row, i: int, done: Done, framed: bool = False) -> None:
        path = self._file(key)
        tmp = f"{path[:-5]}.{threading.get_ident()}.tmp"
        start = time.perf_counter()
        try:
            self._make_room()
            if framed:
                assert isinstance(row, memoryview)
                seal(row, key, self.fingerprint, self.hash_algo, self.mac_key)
                buffers: list[bytes | memoryview] = [row]
            else:
                header = encode_header(key, row, self.fingerprint, self.hash_algo, self.mac_key)
                buffers = [header, *payload_parts(row)]
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
                _write_all(fd, buffers)  # one write(v) for header and row
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.stats.add(errors=1, skipped_writes=1)
            full = exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            self._log.error("full" if full else "write",
                            f"disk tier: {'disk full' if full else 'write failed'} ({exc}); pages are not written "
                            "to disk until it recovers, serving continues")  # fmt: skip
            with self._lock:
                self._writing.discard(key)
        else:
            with self._lock:
                self._writing.discard(key)
                self._index[key] = None
            self._make_room(writing=False)
            self.stats.add(pages_stored=1, bytes_stored=self.row_bytes)
            self.stats.observe("store", time.perf_counter() - start)
            self._log.recovered("full", "disk tier: writes succeed again")
        finally:
            done(i)

    def _make_room(self, writing: bool = True) -> None:
        """Delete least recently used pages until the pages being written fit under the cap (`writing` False: until
        the stored ones do; a writer calls it again once its page is indexed, so pages written side by side never
        leave the disk over the cap)."""
        with self._lock:  # (chosen and unindexed under one lock: two writers never pick the same victim)
            over = len(self._index) + (len(self._writing) if writing else 0) - self.capacity
            victims = list(itertools.islice(self._index, over)) if over > 0 else []  # O(victims), not O(index)
            for key in victims:
                del self._index[key]
        if victims:
            self.stats.add(evictions=len(victims))
            self._unlink(victims)

    def _delete(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._index.pop(key, None)
        self._unlink(keys)

    def _unlink(self, keys: list[bytes]) -> None:
        """Remove the files of `keys` (no longer indexed) and tell the listeners. A file that cannot be removed
        (a read-only bucket, a directory in its place) is counted and logged, and the rest go on: writers and
        their callbacks never stop on it, and nothing serves that page again (it is unindexed)."""
        for key in keys:
            try:
                os.unlink(self._file(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.stats.add(errors=1)
                self._log.error("delete", f"disk tier: deleting {self._file(key)} failed ({exc}); it stays on disk")
        if self.emit is not None and keys:
            self.emit(BlockRemoved(list(keys), self.medium))

    # ----------------------------------------------------------------- maintenance
    def wait(self) -> None:
        for future in list(self._inflight):
            future.result()  # type: ignore[attr-defined]

    def reset(self) -> int:
        self.wait()
        with self._lock:
            keys = list(self._index)
        self._delete(keys)
        return len(keys)

    def shutdown(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def _head(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first `nbytes` of `parts`, as views."""
    out = []
    for part in parts:
        take = min(len(part), nbytes)
        out.append(part[:take])
        nbytes -= take
    return out


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
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


def _read_all(fd: int, parts: list[bytearray | memoryview]) -> int:
    """Read the file from its start into `parts` in order until they are full or it ends (preadv);
    returns the bytes read."""
    views = [memoryview(p).cast("B") for p in parts]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if not n:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]
    return total
