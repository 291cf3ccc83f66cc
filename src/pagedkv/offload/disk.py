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

import errno
import io
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedkv.core.events import BlockRemoved, EventSink
from pagedkv.core.tier_stats import TierStats
from pagedkv.offload.format import HEADER_SIZE, check_page, decode_header, encode_header
from pagedkv.offload.tier import Done, LowerTier, OnceLogger

__all__ = ["DiskTier"]


class DiskTier(LowerTier):
    """Pages of one layout (`fingerprint`) under `directory`, at most `max_bytes` of them."""

    name = "disk"
    medium = "DISK"

    def __init__(
        self, directory: str | os.PathLike[str], row_bytes: int, max_bytes: int, fingerprint: bytes, hash_algo: str,
        *, threads: int = 4, emit: EventSink | None = None,
    ) -> None:  # fmt: skip
        self.root = Path(directory) / fingerprint.hex()
        self.root.mkdir(parents=True, exist_ok=True)
        self.row_bytes = row_bytes
        self.file_bytes = HEADER_SIZE + row_bytes
        self.capacity = max(1, max_bytes // self.file_bytes)
        self.fingerprint = fingerprint
        self.hash_algo = hash_algo
        self.emit = emit
        self.stats = TierStats("disk")
        self._log = OnceLogger("disk")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # pages on disk, oldest first
        self._writing: set[bytes] = set()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-disk")
        self._inflight: set[object] = set()
        self._scan()

    # ----------------------------------------------------------------- layout
    def path(self, key: bytes) -> Path:
        """Where page `key` lives."""
        return self.root / f"{key[0]:02x}" / f"{key.hex()}.page"

    def _scan(self) -> None:
        """Rebuild the index from the files a previous process left (and drop unfinished ones)."""
        found: list[tuple[float, bytes]] = []
        for path in self.root.glob("*/*"):
            if path.suffix != ".page":
                path.unlink(missing_ok=True)  # an interrupted write's temporary file
                continue
            try:
                stat = path.stat()
                key = bytes.fromhex(path.stem)
            except (OSError, ValueError):
                continue
            if stat.st_size == self.file_bytes:
                found.append((stat.st_mtime, key))
        for _, key in sorted(found):
            self._index[key] = None

    @property
    def num_pages(self) -> int:
        return self.capacity

    @property
    def num_used_pages(self) -> int:
        return len(self._index)

    # ----------------------------------------------------------------- reads
    def fetch(self, keys: Sequence[bytes], dest: Sequence[memoryview]) -> int:
        futures = [self._pool.submit(self._read, key, view) for key, view in zip(keys, dest, strict=True)]
        count = 0
        for future in futures:
            if not future.result():
                break
            count += 1
        for future in futures[count:]:  # nothing may write into `dest` after we return
            if not future.cancel():
                future.result()
        with self._lock:
            for key in keys[:count]:
                if key in self._index:
                    self._index.move_to_end(key)
                else:
                    self._index[key] = None  # written by another process sharing the directory
        return count

    def _read(self, key: bytes, view: memoryview) -> bool:
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                header = decode_header(f.read(HEADER_SIZE))
                got = _read_all(f, view)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.stats.add(errors=1)
            self._log.error("read", f"disk tier: reading {path} failed ({exc}); the page is recomputed")
            return False
        reason = check_page(header, view[:got], key, self.fingerprint, self.hash_algo, self.row_bytes)
        if reason is None and got == self.row_bytes:
            return True
        self.stats.add(refused=1)
        self._log.error("refused", f"disk tier: refused {path}: {reason or 'short file'}; the page is recomputed")
        self._delete([key])
        return False

    # ----------------------------------------------------------------- writes
    def store(self, keys: Sequence[bytes], rows: Sequence[memoryview], done: Done) -> None:
        for i, (key, row) in enumerate(zip(keys, rows, strict=True)):
            with self._lock:
                skip = key in self._index or key in self._writing
                if not skip:
                    self._writing.add(key)
            if skip:
                done(i)
                continue
            future = self._pool.submit(self._write, key, row, i, done)
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)

    def _write(self, key: bytes, row: memoryview, i: int, done: Done) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{path.stem}.{threading.get_ident()}.tmp")
        start = time.perf_counter()
        try:
            self._make_room()
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, memoryview(encode_header(key, row, self.fingerprint, self.hash_algo)))
                _write_all(f, row)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
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
            self.stats.add(pages_stored=1, bytes_stored=self.row_bytes)
            self.stats.observe("store", time.perf_counter() - start)
            self._log.recovered("full", "disk tier: writes succeed again")
        finally:
            done(i)

    def _make_room(self) -> None:
        """Delete least recently used pages until one more fits under the cap."""
        with self._lock:
            over = len(self._index) + len(self._writing) - self.capacity
            victims = list(self._index)[: max(0, over)]
        if victims:
            self.stats.add(evictions=len(victims))
            self._delete(victims)

    def _delete(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._index.pop(key, None)
        for key in keys:
            self.path(key).unlink(missing_ok=True)
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


def _write_all(f: io.RawIOBase, data: memoryview) -> None:
    """Write all of `data` (a raw file may take less per call; the call after a short one raises)."""
    data = data.cast("B")
    while data:
        n = f.write(data)
        if not n:
            raise OSError(errno.EIO, "write returned 0")
        data = data[n:]


def _read_all(f: io.RawIOBase, view: memoryview) -> int:
    """Read into all of `view` unless the file ends first; returns the bytes read."""
    view = view.cast("B")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got
