"""`DiskTier`: pages as files in a bucketed directory, LRU under a size cap, warm across restarts.

    <disk_offload_dir>/<namespace>/<first hash byte>/<content hash>.page
    <disk_offload_dir>/<namespace>/pages.journal

The namespace is the layout fingerprint, and for signed pages the HMAC key's
public id (`format.tier_namespace`): engines of another layout or key never
open each other's pages. One file per page (header + row, `offload.format`),
written to a temporary name and renamed into place, so a reader never sees a
torn page: a crash leaves either the old state or a complete file (and a file
the kernel lost after a power cut fails its checksum and is refused). Why
files, not one preallocated file: rename makes each page atomic without a
journal of page bytes, another process (or a restarted one) finds a page by
its name alone, deleting frees disk space at once, and pages of another model
or layout live in their own subdirectory instead of corrupting a shared slot map.

The size cap is the directory's: every process writing it keeps one LRU index
through `pages.journal` (`offload.disk_index`), rebuilt against the files at
start; a write job reserves its pages under one lock of the journal and
records them stored under one more. Reads run on reader threads and are
bounded in time (`offload.disk_io`): a read that makes no progress for
`timeout_s` is abandoned, a miss. Rows the caller lends (``fetch(...,
done=)``) are read straight into, each handed back once no reader can write
it; other rows through a reader's scratch buffer, never written late. Only a
regular file is a page: a FIFO, device, socket, directory or link at a page's
name is refused without being opened for reading (no read can block on it).

A page this reader refuses (not a regular file, wrong size, header, layout,
key or tag) is a miss for it, counted and logged, and left where it is: a
reader never deletes a page. What removes it: the size cap's LRU (a refused
page is never used, so it ages out), `reset`, and a write of the same page by
this tier after it computed it again (a page it refused is written over; any
other page already stored is skipped).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedkv.core.events import BlockRemoved, EventSink
from pagedkv.offload.disk_index import DiskIndex, scan
from pagedkv.offload.disk_io import CHUNK, ReadBatch, head, read_lent, read_through, write_file
from pagedkv.offload.format import (
    HEADER_SIZE,
    check_header,
    check_page,
    decode_header,
    encode_header,
    key_id,
    payload_parts,
    seal,
    tier_namespace,
)
from pagedkv.offload.tier import Done, LowerTier, OnceLogger, Row, check_framed
from pagedkv.offload.tier_stats import TierStats

__all__ = ["DiskTier"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# a page that is a symbolic link is refused (ELOOP), never followed; opening a FIFO never waits for a writer
_READ = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
MAX_REFUSED = 4096  # refused pages remembered (so the same bad file is counted once, and written over)
FLUSH_USES, FLUSH_S = 1024, 1.0  # reads noted before the journal records them: at most so many, so long
NOT_REGULAR = "not a regular file (a FIFO, device, socket or directory); it is not read"


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_mode


class DiskTier(LowerTier):
    """Pages of one layout (`fingerprint`) under `directory`, at most `max_bytes` of them, whatever the number
    of processes writing it. Reads that make no progress for `timeout_s` seconds are misses."""

    name = "disk"
    medium = "DISK"

    def __init__(
        self, directory: str | os.PathLike[str], row_bytes: int, max_bytes: int, fingerprint: bytes, hash_algo: str,
        *, threads: int = 4, emit: EventSink | None = None, mac_key: bytes | None = None, timeout_s: float = 5.0,
    ) -> None:  # fmt: skip
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        self.namespace = tier_namespace(fingerprint, mac_key)
        self.root = Path(directory) / self.namespace
        self.root.mkdir(parents=True, exist_ok=True)
        self.row_bytes = row_bytes
        self.file_bytes = HEADER_SIZE + row_bytes
        self.capacity = max(1, max_bytes // self.file_bytes)
        self.fingerprint = fingerprint
        self.hash_algo = hash_algo
        self.mac_key = mac_key  # sign every write, require a signature on every read
        self.key_id = None if mac_key is None else key_id(mac_key)
        self.timeout_s = timeout_s
        self.emit = emit
        self.stats = TierStats("disk")
        self._log = OnceLogger("disk")
        self._lock = threading.Lock()
        self._writing: set[bytes] = set()
        self._flushing = False  # a task recording reads in the journal is queued
        self._flushed = 0.0  # when the last one ran (time.monotonic())
        self._refused: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()  # key -> the refused file's identity
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-disk")
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-disk-read")
        self._scratch = threading.local()  # each reader thread's chunk buffer
        self._inflight: set[object] = set()
        self._root = str(self.root)
        self._index = DiskIndex(self._root, self.capacity, timeout_s, self._index_error)
        self._scan()

    # ----------------------------------------------------------------- layout
    def path(self, key: bytes) -> Path:
        """Where page `key` lives."""
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        """`path(key)` as a string (no pathlib on the hot paths)."""
        return f"{self._root}/{key[0]:02x}/{key.hex()}.page"

    def _scan(self) -> None:
        """Rebuild the index from the files a previous process left (`disk_index.scan`), against the journal."""
        try:
            self._index.reconcile(scan(self._root, self.file_bytes))
        except OSError as exc:
            self._index_error("start", f"disk tier: indexing {self._root} failed ({exc}); pages are indexed as "
                                       "they are written and read")  # fmt: skip

    def _index_error(self, kind: str, message: str) -> None:
        """Log (once per kind) a problem of the index; count it unless it is a journal write (that only
        happens with page writes failing beside it, which are counted)."""
        if kind != "journal-write":
            self.stats.add(errors=1)
        self._log.error(kind, message)

    @property
    def num_pages(self) -> int:
        return self.capacity

    @property
    def num_used_pages(self) -> int:
        """Pages of the directory (every process's), as of this process's last look at the journal."""
        return len(self._index)

    # ----------------------------------------------------------------- reads
    def fetch(self, keys: Sequence[bytes], dest: Sequence[Row], done: Done | None = None) -> int:
        """Up to `threads` reader runs take every `threads`-th page, in order; a miss or refusal at page i stops
        every run at i (pages before it are all read). Waits until they are done or no page was read for
        `timeout_s` (then the pages not read are misses). With `done` (rows lent, `LowerTier.fetch`) the runs
        read straight into the rows, and a row a run was reading when the wait gave up is handed back by that
        run once its read ends; without, nothing writes into `dest` after this returns."""
        total = len(keys)
        if total != len(dest):
            raise ValueError(f"{len(keys)} keys but {len(dest)} destination rows")
        if not total:
            return 0
        runs = max(1, min(self._threads, total))
        batch = ReadBatch(total, runs, stop_at_miss=True, done=done)
        for run in range(runs):
            self._readers.submit(self._read_run, batch, keys, dest, run)
        if not batch.wait(self.timeout_s):
            self._timed_out("read", batch.prefix(), total)
        count = batch.prefix()
        batch.hand_back()
        if count:
            self._note_uses(keys[:count])
        return count

    def _note_uses(self, keys: Sequence[bytes]) -> None:
        """Make `keys` the most recently used: noted in memory now, recorded in the journal by the next write, or
        by a task on a writer thread once many are noted or a second passed (nothing waits for it here)."""
        pending = self._index.used(keys)
        now = time.monotonic()
        with self._lock:
            flush = not self._flushing and (pending >= FLUSH_USES or now - self._flushed >= FLUSH_S)
            self._flushing = self._flushing or flush
        if flush:
            future = self._pool.submit(self._flush_uses)
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)

    def _flush_uses(self) -> None:
        with self._lock:
            self._flushing, self._flushed = False, time.monotonic()
        try:
            self._index.flush()
        except OSError as exc:
            self._index_error("index", f"disk tier: recording reads in {self._root} failed ({exc})")

    def _timed_out(self, what: str, done: int, total: int) -> None:
        self.stats.add(errors=1)
        self._log.error("timeout", f"disk tier: a {what} of {self._root} made no progress for {self.timeout_s}s "
                                   f"({done} of {total} pages done); the rest are misses, serving continues")  # fmt: skip

    def _read_run(self, batch: ReadBatch, keys: Sequence[bytes], dest: Sequence[Row], run: int) -> None:
        try:
            for i in range(run, batch.total, batch.runs):
                if batch.done is None:
                    if not batch.live(i):
                        return
                    ok = self._read(keys[i], dest[i], batch, run)
                    batch.finish(i, ok)
                else:
                    if not batch.claim(run, i):
                        return
                    ok = False
                    try:
                        ok = self._read(keys[i], dest[i], batch, run)
                    finally:
                        batch.finish(i, ok, run)  # (hands the row back when the batch was abandoned meanwhile)
                if not ok:
                    return
        finally:
            batch.run_ended()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """One `stat` per key, on a reader thread (another process sharing the directory may have written it):
        a regular file that this tier has not refused as it is (nothing is read: `fetch` may still refuse it).
        False for keys not looked at within `timeout_s`."""

        def there(key: bytes) -> bool:
            try:
                info = os.stat(self._file(key), follow_symlinks=False)
            except OSError:
                return False
            return stat.S_ISREG(info.st_mode) and self._refused.get(key) != _identity(info)

        return self._each(keys, there, "lookup")

    def probe(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: the file is a regular file of one page's size whose header passes `check_header`; one open and
        a 112-byte read each, on a reader thread. A page that fails is refused (counted, logged once, left in
        place); False for keys not looked at within `timeout_s`."""
        return self._each(keys, self._probe_one, "lookup")

    def _each(self, keys: Sequence[bytes], check: Callable[[bytes], bool], what: str) -> list[bool]:
        """`check(key)` for every key on a reader thread, bounded by `timeout_s` without progress."""
        if not keys:
            return []
        batch = ReadBatch(len(keys), 1, stop_at_miss=False)

        def run() -> None:
            try:
                for i, key in enumerate(keys):
                    if batch.abandoned:
                        return
                    batch.finish(i, check(key))
            finally:
                batch.run_ended()

        self._readers.submit(run)
        if not batch.wait(self.timeout_s):
            self._timed_out(what, sum(batch.results()), len(keys))
        return batch.results()

    def _probe_one(self, key: bytes) -> bool:
        path = self._file(key)
        opened = self._open(key, path)
        if isinstance(opened, bool):
            return opened
        fd, info = opened
        try:
            raw = os.pread(fd, HEADER_SIZE, 0)
        except OSError as exc:
            return self._read_failed(path, exc)
        finally:
            os.close(fd)
        reason = check_header(decode_header(raw), key, self.fingerprint, self.hash_algo, self.row_bytes, self.mac_key,
                              info.st_size)  # fmt: skip
        return True if reason is None else self._refuse(key, path, reason, info)

    def _open(self, key: bytes, path: str) -> tuple[int, os.stat_result] | bool:
        """(fd, fstat) of page `key`'s file if it is a regular file of one page's size that this tier has not
        refused as it is; otherwise False (a miss: missing, or refused: counted once per version of the file)."""
        try:
            fd = os.open(path, _READ)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a socket
                return self._read_failed(path, exc)
            try:
                info = os.stat(path, follow_symlinks=False)
            except OSError:
                return False
            return self._refuse(key, path, "a symbolic link" if exc.errno == errno.ELOOP else NOT_REGULAR, info)
        try:
            info = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            return self._read_failed(path, exc)
        reason = None
        if not stat.S_ISREG(info.st_mode):
            reason = NOT_REGULAR
        elif info.st_size != self.file_bytes:
            reason = f"stored page of {info.st_size} bytes, expected {self.file_bytes} (truncated or padded)"
        refused = self._refused.get(key)
        if reason is not None or (refused is not None and refused == _identity(info)):
            os.close(fd)
            return False if reason is None else self._refuse(key, path, reason, info)
        return fd, info

    def _refuse(self, key: bytes, path: str, reason: str, info: os.stat_result) -> bool:
        """Count and log (once) a refused page, and remember it (the same file is not counted again; this tier
        writes over it when it stores the page); the file stays where it is. False."""
        identity = _identity(info)
        with self._lock:
            seen = self._refused.get(key) == identity
            self._refused[key] = identity
            self._refused.move_to_end(key)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
        if not seen:
            self.stats.add(refused=1)
            self._log.error("refused", f"disk tier: refused {path}: {reason}; it is a miss (left in place) and the "
                                       "page is recomputed")  # fmt: skip
        return False

    def _read(self, key: bytes, row: Row, batch: ReadBatch, run: int) -> bool:
        """Read and check page `key` into `row`: straight into it when lent (`batch.done`), else chunk by chunk
        through this thread's scratch buffer, copied under the run's guard while the batch is live."""
        path = self._file(key)
        opened = self._open(key, path)
        if isinstance(opened, bool):
            return opened
        fd, info = opened
        parts = payload_parts(row)
        try:
            if batch.done is not None:
                header, got = read_lent(fd, self._buffer("header", HEADER_SIZE), parts)
            else:
                read = read_through(fd, self._buffer("chunk", HEADER_SIZE + min(CHUNK, self.row_bytes)), parts,
                                    self.row_bytes, batch, run)  # fmt: skip
                if read is None:  # abandoned
                    return False
                header, got = read
        except OSError as exc:
            return self._read_failed(path, exc)
        finally:
            os.close(fd)
        payload = parts if got == self.row_bytes else head(parts, got)
        reason = check_page(decode_header(header), payload, key, self.fingerprint, self.hash_algo, self.row_bytes,
                            self.mac_key)  # fmt: skip
        if reason is None and got == self.row_bytes:
            return True
        return self._refuse(key, path, reason or "short file", info)

    def _buffer(self, name: str, size: int) -> memoryview:
        """This reader thread's buffer `name` of `size` bytes."""
        buffer: memoryview | None = getattr(self._scratch, name, None)
        if buffer is None:
            buffer = memoryview(bytearray(size))
            setattr(self._scratch, name, buffer)
        return buffer

    def _read_failed(self, path: str, exc: OSError) -> bool:
        self.stats.add(errors=1)
        self._log.error("read", f"disk tier: reading {path} failed ({exc}); the page is recomputed")
        return False

    # ----------------------------------------------------------------- writes
    def store(self, keys: Sequence[bytes], rows: Sequence[Row], done: Done, *, framed: bool = False) -> None:
        """The pages not being written go to up to `threads` jobs (every `threads`-th page each): one task per
        job, not per page, so small pages do not pay a thread handoff each. A job skips a page that is stored
        (indexed, its file there) unless this tier refused it, and writes the others: a framed row sealed in
        place with one write, another row as header and parts with one writev. Nothing touches the file system
        on the calling thread."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        if framed:
            check_framed(rows, self.file_bytes)
        todo: list[int] = []
        skipped: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._writing:
                    skipped.append(i)  # another job of this process is writing that page
                else:
                    self._writing.add(key)
                    todo.append(i)
        for i in skipped:
            done(i)
        jobs = min(self._threads, len(todo))
        for first in range(jobs):
            index = todo[first::jobs]
            future = self._pool.submit(self._write_job, [keys[i] for i in index], [rows[i] for i in index], index, done,
                                       framed)  # fmt: skip
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)

    def _write_job(self, keys: list[bytes], rows: list[Row], index: list[int], done: Done, framed: bool) -> None:
        """Write the pages in groups: each group reserved under one journal lock and recorded stored under one
        more (a group is at most a `threads`-th of the cap, so the pages written side by side still fit it)."""
        size = max(1, min(len(keys), self.capacity // self._threads))
        for lo in range(0, len(keys), size):
            self._write_group(keys[lo : lo + size], rows[lo : lo + size], index[lo : lo + size], done, framed)

    @staticmethod
    def _regular(path: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def _present(self, key: bytes) -> bool:
        """Nothing to write for `key`: its file is there and this tier has not refused it (a page it refused
        is written over; a file deleted behind the index, by an operator or lost, is written again)."""
        return key not in self._refused and self._regular(self._file(key))

    def _write_group(self, keys: list[bytes], rows: list[Row], index: list[int], done: Done, framed: bool) -> None:
        """Reserve the pages not stored (checked without the lock first, then under it), write each to a
        temporary file renamed into place, record the written ones stored; ``done(i)`` for every page at the
        end. A page whose write fails is counted and its reservation abandoned; the others go on."""
        try:
            wanted = [key for key in keys if not (key in self._index and self._present(key))]
            try:
                todo, victims = self._index.reserve_all(wanted, self._present) if wanted else ([], [])
            except OSError as exc:  # the journal's lock stayed busy: nothing reserved, nothing written
                for _ in wanted:
                    self._write_failed(exc)
                return
            self._evict(victims)
            rows_of = dict(zip(keys, rows, strict=True))
            written: list[bytes] = []
            took: list[float] = []
            for key in todo:
                start = time.perf_counter()
                path = self._file(key)
                tmp = f"{path[:-5]}.{threading.get_ident()}.tmp"
                try:
                    self._write_file(key, rows_of[key], path, tmp, framed)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    self._index.abandon(key, functools.partial(os.path.isfile, path))
                    self._write_failed(exc)
                else:
                    written.append(key)
                    took.append(time.perf_counter() - start)
            if written:
                try:
                    self._evict(self._index.stored_all(written))
                except OSError as exc:  # the files are in place, reserved in the index: counted as failed writes
                    for key in written:
                        self._index.abandon(key, functools.partial(os.path.isfile, self._file(key)))
                        self._write_failed(exc)
                    written = []
            if written:
                with self._lock:
                    for key in written:
                        self._refused.pop(key, None)
                self.stats.add(pages_stored=len(written), bytes_stored=len(written) * self.row_bytes)
                for seconds in took:
                    self.stats.observe("store", seconds)
                self._log.recovered("full", "disk tier: writes succeed again")
        finally:  # (whatever happened: each row is handed back, each page no longer being written)
            self._release(keys, index, done)

    def _release(self, keys: list[bytes], index: list[int], done: Done) -> None:
        with self._lock:
            self._writing.difference_update(keys)
        for i in index:
            done(i)

    def _write_file(self, key: bytes, row: Row, path: str, tmp: str, framed: bool) -> None:
        """Page `key` (header + `row`) written to `tmp` with one write(v) and renamed to `path`."""
        if framed:
            assert isinstance(row, memoryview)
            seal(row, key, self.fingerprint, self.hash_algo, self.mac_key)
            buffers: list[bytes | memoryview] = [row]
        else:
            header = encode_header(key, row, self.fingerprint, self.hash_algo, self.mac_key)
            buffers = [header, *payload_parts(row)]
        write_file(path, tmp, buffers)

    def _write_failed(self, exc: OSError) -> None:
        self.stats.add(errors=1, skipped_writes=1)
        full = exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
        self._log.error("full" if full else "write",
                        f"disk tier: {'disk full' if full else 'write failed'} ({exc}); pages are not written "
                        "to disk until it recovers, serving continues")  # fmt: skip

    def _evict(self, victims: list[bytes]) -> None:
        """Delete the files of pages the index evicted (no longer indexed) and count them."""
        if victims:
            self.stats.add(evictions=len(victims))
            self._unlink(victims)

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
        """Delete every page of this directory (every process's); returns how many."""
        self.wait()
        try:
            keys = self._index.remove_all()
        except OSError as exc:
            self._index_error("reset", f"disk tier: resetting {self._root} failed ({exc})")
            return 0
        with self._lock:
            self._refused.clear()
        self._unlink(keys)
        return len(keys)

    def shutdown(self) -> None:
        """Finish pending writes and stop the threads (a read stuck in the file system is not waited for)."""
        self.wait()
        self._pool.shutdown(wait=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._index.close()
