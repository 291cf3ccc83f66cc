"""Disk tier, each scenario in real processes: warm restart, a corrupted page, a full disk, the size cap."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pagedkv.core.hashing import hash_tokens
from pagedkv.offload.disk import DiskTier
from pagedkv.offload.format import HEADER_SIZE

PROMPT = list(range(1, 30))  # 29 tokens, pages of 4: the first 7 pages are a shareable prefix
ROW = 2 * 2 * 4 * 2 * 4 * 4  # K/V x layers x page x heads x head_dim x fp32 = 512 bytes
FILE = HEADER_SIZE + ROW


def spec(directory: Path, **extra: Any) -> dict[str, Any]:
    return {"connector": "tiered", "dir": str(directory), "prompts": [PROMPT], "host_pages": 16, **extra}


def page_file(directory: Path, index: int) -> Path:
    key = hash_tokens(PROMPT + [1000, 1001, 1002, 1003], 4)[index]  # the prompt and the 4 tokens it generates
    [layout] = [d for d in directory.iterdir() if d.is_dir()]
    return layout / f"{key[0]:02x}" / f"{key.hex()}.page"


def test_warm_restart_reads_what_a_previous_process_wrote(tmp_path: Path, worker: Any) -> None:
    first = worker(spec(tmp_path))
    assert first["cached"] == [0] and first["stats"]["disk"]["pages_stored"] == 8  # 29 + 4 tokens: 8 full pages
    assert first["disk_used"] == 8 and page_file(tmp_path, 6).stat().st_size == FILE
    second = worker(spec(tmp_path))  # a new process: empty device and host, the disk is warm
    assert second["cached"] == [28] and second["checked"] >= 28  # every cached position's KV was checked
    disk, host = second["stats"]["disk"], second["stats"]["host"]
    assert (disk["pages_loaded"], disk["lookups"], host["pages_loaded"]) == (7, 7, 0)
    assert host["pages_stored"] >= 7  # promoted into host rows on the way up


def test_small_host_tier_stages_disk_reads(tmp_path: Path, worker: Any) -> None:
    worker(spec(tmp_path))
    second = worker(spec(tmp_path, host_pages=2))  # 7 pages do not fit in 2 host rows: a staging buffer is used
    assert second["cached"] == [28] and second["stats"]["disk"]["pages_loaded"] == 7


def test_corrupted_page_is_refused_counted_and_recomputed(tmp_path: Path, worker: Any) -> None:
    worker(spec(tmp_path))
    victim = page_file(tmp_path, 2)
    data = bytearray(victim.read_bytes())
    data[HEADER_SIZE + 100] ^= 0xFF  # one payload byte
    victim.write_bytes(bytes(data))
    second = worker(spec(tmp_path))
    assert second["cached"] == [8]  # pages 0-1 from disk, page 2 refused, the rest recomputed
    assert second["stats"]["disk"]["refused"] == 1 and second["stats"]["disk"]["pages_loaded"] == 2
    assert victim.stat().st_size == FILE  # recomputed and written again
    third = worker(spec(tmp_path))
    assert third["cached"] == [28] and third["stats"]["disk"]["refused"] == 0


def test_full_disk_skips_writes_and_serving_continues(tmp_path: Path, worker: Any) -> None:
    report = worker(spec(tmp_path, prompts=[PROMPT, PROMPT], fsize_limit=100))  # no page file fits
    disk = report["stats"]["disk"]
    assert disk["pages_stored"] == 0 and disk["errors"] == disk["skipped_writes"] >= 8 and report["disk_used"] == 0
    assert report["cached"] == [0, 28] and report["checked"] > 28  # the host tier still serves the repeat
    assert not list(tmp_path.rglob("*.page")) and not list(tmp_path.rglob("*.tmp"))


def test_full_tmpfs(tmp_path: Path, worker: Any) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    # 8 KiB: one block for the directory's page journal, one for a page file; the second page fills the disk
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs privileges this machine does not give (the RLIMIT test covers it)")
    try:
        report = worker(spec(mount, prompts=[PROMPT, PROMPT]))
        disk = report["stats"]["disk"]
        assert 0 < disk["pages_stored"] < 8 and disk["errors"] == disk["skipped_writes"] > 0
        assert report["cached"] == [0, 28]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_size_cap_deletes_least_recently_used(tmp_path: Path, worker: Any) -> None:
    report = worker(spec(tmp_path, max_gb=3 * FILE / 1024**3))
    disk = report["stats"]["disk"]
    assert report["disk_used"] == 3 and disk["pages_stored"] == 8 and disk["evictions"] == 5
    assert len(list(tmp_path.rglob("*.page"))) == 3
    assert page_file(tmp_path, 7).exists()  # the last one written (alone, by the last step) stays


class _YieldingLock:
    """A lock that lets the other threads run right after each release: what a loaded machine does now and then."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        time.sleep(0.0005)


@pytest.mark.parametrize("capacity", [1, 4])
def test_concurrent_writers_keep_the_cap_exactly(tmp_path: Path, capacity: int) -> None:
    """Eight writer threads past a small cap, each yielding after every locked section: each eviction is decided and
    unindexed under one lock, so no two writers delete the same victim; the cap holds exactly and every page beyond
    it is counted once."""
    tier = DiskTier(tmp_path, 64, capacity * (HEADER_SIZE + 64), b"c" * 16, "sha256", threads=8)
    tier._lock = _YieldingLock()  # type: ignore[assignment]
    keys = [bytes([i % 256, i // 256]) + bytes(30) for i in range(400)]
    done: list[int] = []
    tier.store(keys, [memoryview(bytes([i % 251]) * 64) for i in range(400)], done.append)
    tier.wait()
    assert sorted(done) == list(range(400))
    stats = tier.stats.snapshot()
    assert (stats["pages_stored"], stats["evictions"]) == (400, 400 - capacity)
    assert tier.num_used_pages == capacity == len(list(tmp_path.rglob("*.page")))
    tier.shutdown()


def test_a_victim_that_cannot_be_deleted_is_counted_and_writing_goes_on(tmp_path: Path, monkeypatch: Any) -> None:
    """Deleting an evicted page fails (a read-only bucket, say): each failure is counted as an error and logged, the
    page is unindexed all the same, and every writer finishes its pages: each gets its callback, none stays marked
    as being written, the index keeps the cap."""
    real = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith(".page"):
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    tier = DiskTier(tmp_path, 64, 2 * (HEADER_SIZE + 64), b"d" * 16, "sha256", threads=4)
    tier._lock = _YieldingLock()  # type: ignore[assignment]
    monkeypatch.setattr(os, "unlink", refuse)
    keys = [bytes([i, 7]) + bytes(30) for i in range(60)]
    done: list[int] = []
    tier.store(keys, [memoryview(bytes([i]) * 64) for i in range(60)], done.append)
    tier.wait()
    monkeypatch.undo()
    stats = tier.stats.snapshot()
    assert sorted(done) == list(range(60)) and not tier._writing
    assert (stats["pages_stored"], stats["evictions"], stats["errors"]) == (60, 58, 58)
    assert tier.num_used_pages == 2 and len(list(tmp_path.rglob("*.page"))) == 60  # (the refused files stay)
    tier.shutdown()


def _cap_writer(directory: str, writer: int, barrier: Any, out: Any) -> None:
    """One writer process: 60 pages of its own through a tier capped at 20 pages on the shared directory."""
    tier = DiskTier(directory, 64, 20 * (HEADER_SIZE + 64), b"p" * 16, "sha256", threads=4)
    keys = [bytes([writer, i]) + bytes(30) for i in range(60)]
    barrier.wait()  # the three write at once
    for lo in range(0, 60, 10):
        tier.store(
            keys[lo : lo + 10], [memoryview(bytes([writer, i]) * 32) for i in range(lo, lo + 10)], lambda i: None
        )
    tier.wait()
    out.put(tier.stats.snapshot())
    tier.shutdown()


def test_the_cap_is_the_directorys_across_processes(tmp_path: Path) -> None:
    """Three writer processes, each with a 20-page cap on one directory, write 60 pages each at once: 20 page files
    remain, every page was evicted at most once (by whichever process), a new process indexes exactly those 20,
    and every one of them reads back whole."""
    context = multiprocessing.get_context("fork")  # (the writers need only what this process imported)
    barrier, out = context.Barrier(3), context.Queue()
    writers = [context.Process(target=_cap_writer, args=(str(tmp_path), w, barrier, out)) for w in range(3)]
    for p in writers:
        p.start()
    stats = [out.get(timeout=120) for _ in writers]
    for p in writers:
        p.join(120)
        assert p.exitcode == 0
    files = sorted(tmp_path.rglob("*.page"))
    assert len(files) == 20
    assert sum(s["pages_stored"] for s in stats) == 180 and sum(s["evictions"] for s in stats) == 160
    assert all(s["errors"] == s["refused"] == 0 for s in stats)
    reader = DiskTier(tmp_path, 64, 20 * (HEADER_SIZE + 64), b"p" * 16, "sha256", threads=2)
    assert reader.num_used_pages == 20
    keys = [bytes.fromhex(f.stem) for f in files]
    dest = [bytearray(64) for _ in keys]
    assert reader.fetch(keys, [memoryview(d) for d in dest]) == 20
    assert all(d == bytes([k[0], k[1]]) * 32 for k, d in zip(keys, dest, strict=True))
    reader.shutdown()


def test_a_read_that_blocks_is_abandoned_and_never_writes_late(tmp_path: Path, monkeypatch: Any) -> None:
    """The file system stops answering in the middle of a page (a dead NFS server, a FUSE daemon that never
    replies; here `preadv` of that file waits for the test): `fetch` returns a miss once no page made progress
    for `timeout_s`, while the read is still stuck, and when the read finally returns, the row given to the
    abandoned fetch stays untouched. (The fetch runs on a thread with a deadline: a fetch that waits for the
    stuck read fails the test instead of hanging it.)"""
    tier = DiskTier(tmp_path, 64, 1 << 20, b"t" * 16, "sha256", threads=1, timeout_s=0.2)
    key, row = bytes([9]) * 32, bytes(range(64))
    tier.store([key], [memoryview(row)], lambda i: None)
    tier.wait()
    stuck, release = stuck_reads(monkeypatch, str(tier.path(key)))
    dest = bytearray(64)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(tier.fetch([key], [memoryview(dest)])), daemon=True)
    thread.start()
    thread.join(30)
    returned = not thread.is_alive()
    release.set()
    thread.join(30)
    assert stuck.is_set() and returned, "fetch waited for a read stuck in the file system"
    assert got == [0] and tier.stats.errors == 1 and tier.stats.refused == 0
    # a probe runs on the one reader thread after the stuck read's run: once one answers, that run has ended
    assert any(tier.probe([key]) == [True] for _ in range(50))
    assert dest == bytes(64)  # the late read wrote nothing into the abandoned fetch's row
    monkeypatch.undo()
    assert tier.fetch([key], [memoryview(dest)]) == 1 and dest == row
    tier.shutdown()


def stuck_reads(monkeypatch: Any, page: str) -> tuple[threading.Event, threading.Event]:
    """`preadv` of `page` waits until the second event is set (the first tells that it started): a file system
    that stops answering in the middle of that page."""
    real, stuck, release = os.preadv, threading.Event(), threading.Event()

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") == page and not release.is_set():
            stuck.set()
            release.wait(60)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return stuck, release


def test_lent_rows_are_read_into_and_each_handed_back_once_before_the_fetch_returns(tmp_path: Path) -> None:
    """With `done` the pages are read straight into the rows; every row is handed back exactly once, before
    `fetch` returns, whether it holds a page, is past a missing page, or was never read."""
    tier = DiskTier(tmp_path, 64, 1 << 20, b"t" * 16, "sha256", threads=3)
    keys = [bytes([k]) * 32 for k in range(1, 9)]
    rows = [bytes([k]) * 64 for k in range(1, 9)]
    tier.store(keys[:5] + keys[6:], [memoryview(r) for r in rows[:5] + rows[6:]], lambda i: None)  # no page 5
    tier.wait()
    dest = [bytearray(64) for _ in keys]
    back: list[int] = []
    assert tier.fetch(keys, [memoryview(d) for d in dest], done=back.append) == 5
    assert sorted(back) == list(range(8))  # each row once, all before the return
    assert [bytes(d) for d in dest[:5]] == rows[:5]
    back.clear()
    assert tier.fetch(keys[:5], [memoryview(d) for d in dest[:5]], done=back.append) == 5 and back == list(range(5))
    tier.shutdown()


def test_a_lent_row_whose_read_is_abandoned_is_handed_back_once_the_read_ends(tmp_path: Path, monkeypatch: Any) -> None:
    """A lent row's read that the file system holds up: `fetch` returns a miss after `timeout_s` without handing
    that row back (the stuck read may still write into it); the row not read is handed back at once. When the
    read ends, its reader thread hands the row back, exactly once, and from then on nothing writes into it."""
    tier = DiskTier(tmp_path, 64, 1 << 20, b"t" * 16, "sha256", threads=1, timeout_s=0.2)
    keys, rows = [bytes([9]) * 32, bytes([10]) * 32], [bytes(range(64)), bytes(range(1, 65))]
    tier.store(keys, [memoryview(r) for r in rows], lambda i: None)
    tier.wait()
    stuck, release = stuck_reads(monkeypatch, str(tier.path(keys[0])))
    dest = [bytearray(64), bytearray(64)]
    back: list[tuple[int, str]] = []
    handed = threading.Event()

    def done(i: int) -> None:
        back.append((i, threading.current_thread().name))
        if i == 0:
            handed.set()

    got: list[int] = []
    fetch = threading.Thread(target=lambda: got.append(tier.fetch(keys, [memoryview(d) for d in dest], done=done)))
    fetch.start()
    fetch.join(30)
    assert stuck.is_set() and not fetch.is_alive(), "fetch waited for a read stuck in the file system"
    assert got == [0] and [i for i, _ in back] == [1] and tier.stats.errors == 1  # row 0 is still lent
    release.set()
    assert handed.wait(30)
    assert [i for i, _ in back] == [1, 0] and back[1][1].startswith("pagedkv-disk-read")  # by the reader, once
    dest[0][:] = bytes(64)  # the caller reuses the row: nothing writes into it any more
    assert any(tier.probe([keys[0]]) == [True] for _ in range(50))  # (the one reader thread is past that read)
    assert dest[0] == bytes(64) and len(back) == 2
    monkeypatch.undo()
    tier.shutdown()


def test_a_group_of_pages_is_reserved_and_recorded_under_one_journal_lock_each(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A write job takes the journal's lock once to reserve its pages and once to record them stored, not twice
    per page; the journal then holds one reserve and one stored record per page."""
    tier = DiskTier(tmp_path, 64, 1 << 20, b"t" * 16, "sha256", threads=1)
    real, locks = fcntl.flock, []

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_EX:
            locks.append(fd)
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    keys = [bytes([k]) * 32 for k in range(16)]
    tier.store(keys, [memoryview(bytes([k]) * 64) for k in range(16)], lambda i: None)
    tier.wait()
    assert len(locks) == 2 and tier.stats.pages_stored == 16 and tier.num_used_pages == 16
    journal = (tier.root / "pages.journal").read_bytes()[16:]
    ops = [journal[at : at + 1] for at in range(0, len(journal), 34)]
    assert ops.count(b"+") == 16 and ops.count(b"=") == 16
    tier.shutdown()
