"""The host and disk cases of `pagedkv bench tiers`: each tier and its raw medium over the same pages.

A case owns the pages of one run (random bytes, fresh content hashes per
repeat) and does one timed step per call of `run(phase, side)`; everything
else (fresh keys, zeroing destinations, dropping the page cache) happens in
untimed hooks. `side` is ``"ours"`` (the tier's own path) or a raw baseline
(``"raw"``, ``"raw_loop"``); `run` returns the payload bytes it moved (page
rows, headers excluded) so both sides are checked to move the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from pagedkv.offload.disk import DiskTier
from pagedkv.offload.factory import create_connector
from pagedkv.offload.format import HEADER_SIZE, encode_header
from pagedkv.offload.transfer import PageMover
from pagedkv.params.kv import KVCacheParams, KVConnectorType

__all__ = ["DiskCase", "HostCase", "TierCase", "drop_page_cache", "random_rows"]

FINGERPRINT = bytes(range(16))  # the layout fingerprint of every bench page
HASH_ALGO = "sha256"


def random_rows(num: int, row_bytes: int, seed: int = 0) -> torch.Tensor:
    """``uint8 [num, row_bytes]`` of seeded random bytes (written as int64 words: fast)."""
    gen = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**62), 2**62, (num, row_bytes // 8), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)  # [num, row_bytes]


def drop_page_cache(paths: list[Path]) -> None:
    """Write these files back and evict them from the OS page cache (fsync + POSIX_FADV_DONTNEED),
    so the next read comes from the disk. Only these files: nothing else on the machine is touched."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class TierCase(ABC):
    """One tier and its raw medium over `num_pages` pages of `row_bytes`, in batches of `batch`."""

    tier: str = ""
    medium: str = ""  # what the raw side does, for the report
    phases: tuple[str, ...] = ("offload", "load")
    sides: tuple[str, ...] = ("ours", "raw")

    repeat_factor = 1  # cheap cases run this many times more repeats (the best of more runs is steadier)

    def __init__(self, num_pages: int, row_bytes: int, batch: int) -> None:
        self.num_pages, self.row_bytes, self.batch = num_pages, row_bytes, batch
        self.keys: list[bytes] = []
        self.rep = 0  # repeats begun

    def batches(self) -> list[range]:
        """Page index ranges of one pass, `batch` pages each (an engine step's run of pages)."""
        return [range(i, min(i + self.batch, self.num_pages)) for i in range(0, self.num_pages, self.batch)]

    def begin(self) -> None:
        """Before a repeat: fresh content hashes, so nothing is found already stored."""
        self.keys = [os.urandom(32) for _ in range(self.num_pages)]
        self.rep += 1

    def prepare(self, phase: str, side: str) -> None:  # noqa: B027 - optional hook
        """Untimed, right before `run(phase, side)`."""

    @abstractmethod
    def run(self, phase: str, side: str) -> int:
        """One timed pass of `phase` on `side`; returns the payload bytes moved."""

    @abstractmethod
    def verify(self) -> bool:
        """After a load by "ours": the destination holds exactly the stored pages."""

    @abstractmethod
    def end(self) -> None:
        """After a repeat: delete what both sides stored."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads, files and connections."""


class HostCase(TierCase):
    """`KVConnector` with a host tier only (``kv_connector="local"``) vs plain torch copies.

    The device buffer is the replica's real page buffer (on CPU here, so the
    "device" copies are host memcpys), pages stored from shuffled ids and loaded
    into other shuffled ids. Raw: ``index_select(out=)`` / ``index_copy_`` of the
    same pages into a preallocated host tensor ("raw"), and a ``copy_`` per page
    ("raw_loop"); the report takes the faster."""

    tier, medium = "host", "torch copy (index_select / per-page copy_, the faster)"
    sides = ("ours", "raw", "raw_loop")
    repeat_factor = 3

    def __init__(self, params: KVCacheParams, num_pages: int, batch: int, seed: int = 0) -> None:
        params = dataclasses.replace(params, kv_connector=KVConnectorType.local, host_kvcache_swap_space_gb=1.0)
        self.buffer = params.allocate_buffers(2 * num_pages + 1)[0]
        mover = PageMover(self.buffer)
        self.connector = create_connector(params, self.buffer, num_pages, mover=mover)
        super().__init__(num_pages, mover.row_bytes, batch)
        [unit] = mover.units
        self.pages = unit.buffer  # uint8 [2N + 1, row]
        self.pages.copy_(random_rows(2 * num_pages + 1, self.row_bytes, seed))
        order = torch.randperm(2 * num_pages, generator=torch.Generator().manual_seed(seed))
        self.src_ids, self.dst_ids = order[:num_pages], order[num_pages:]  # scattered over the pool
        self.raw = torch.empty((num_pages, self.row_bytes), dtype=torch.uint8)  # [N, row]

    def prepare(self, phase: str, side: str) -> None:
        if phase == "load" and self.rep == 1:  # so the first repeat's `verify` proves the load wrote them
            self.pages.index_fill_(0, self.dst_ids, 0)

    def run(self, phase: str, side: str) -> int:
        host = self.connector.host
        assert host is not None
        if side == "ours":
            before = host.stats.bytes_stored if phase == "offload" else host.stats.bytes_loaded
            for part in self.batches():
                keys = self.keys[part.start : part.stop]
                if phase == "offload":
                    self.connector.offload(self.src_ids[part.start : part.stop].tolist(), keys)
                elif self.connector.load(self.dst_ids[part.start : part.stop].tolist(), keys) != len(keys):
                    raise RuntimeError("host tier: a stored page was not found")
            self.connector.flush()
            return (host.stats.bytes_stored if phase == "offload" else host.stats.bytes_loaded) - before
        for part in self.batches():
            rows = self.raw[part.start : part.stop]
            if side == "raw" and phase == "offload":
                torch.index_select(self.pages, 0, self.src_ids[part.start : part.stop], out=rows)
            elif side == "raw":
                self.pages.index_copy_(0, self.dst_ids[part.start : part.stop], rows)
            else:
                ids = (self.src_ids if phase == "offload" else self.dst_ids)[part.start : part.stop].tolist()
                for row, page in zip(rows, ids, strict=True):
                    (row.copy_(self.pages[page]) if phase == "offload" else self.pages[page].copy_(row))
        return self.num_pages * self.row_bytes

    def verify(self) -> bool:
        return torch.equal(self.pages[self.dst_ids], self.pages[self.src_ids])

    def end(self) -> None:
        self.connector.reset_prefix_cache()

    def close(self) -> None:
        self.connector.shutdown()


class DiskTierCase(TierCase):
    """Shared by the disk and Redis cases: source and destination host rows, precomputed headers."""

    def __init__(self, num_pages: int, row_bytes: int, batch: int, seed: int = 0) -> None:
        super().__init__(num_pages, row_bytes, batch)
        self.src = random_rows(num_pages, row_bytes, seed)  # [N, row]: host rows being offloaded
        self.dst = torch.empty_like(self.src)  # [N, row]: host rows being loaded into
        self.src_views = [memoryview(r) for r in self.src.numpy()]
        self.dst_views = [memoryview(r) for r in self.dst.numpy()]
        self.headers: list[bytes] = []

    def begin(self) -> None:
        super().begin()  # the raw side writes the same header bytes, computed here, untimed
        self.headers = [
            encode_header(k, v, FINGERPRINT, HASH_ALGO) for k, v in zip(self.keys, self.src_views, strict=True)
        ]

    def prepare(self, phase: str, side: str) -> None:
        if phase.startswith("load") and self.rep == 1:  # so the first repeat's `verify` proves the load wrote them
            self.dst.zero_()

    def verify(self) -> bool:
        return torch.equal(self.dst, self.src)


class DiskCase(DiskTierCase):
    """`DiskTier.store` + `wait` / `DiskTier.fetch` vs one file written and read sequentially.

    Neither side fsyncs, so writes land in the OS page cache (the kernel
    writes them back later) and warm reads come from it; the "load_cold"
    phase first writes back and evicts both sides' files (`drop_page_cache`),
    so those reads come from the disk."""

    tier, medium = "disk", "one file, sequential write / read"

    def __init__(self, directory: Path, num_pages: int, row_bytes: int, batch: int, *, cold: bool = True,
                 io_threads: int = 4, seed: int = 0) -> None:  # fmt: skip
        super().__init__(num_pages, row_bytes, batch, seed)
        self.phases = ("offload", "load", "load_cold") if cold else ("offload", "load")
        self.tier_dir = directory / "tier"
        self.raw_path = directory / "raw.bin"
        self.disk = DiskTier(self.tier_dir, row_bytes, 1 << 50, FINGERPRINT, HASH_ALGO, threads=io_threads)

    def prepare(self, phase: str, side: str) -> None:
        super().prepare(phase, side)
        if phase == "load_cold":  # both sides' files: no write-back left to slow the other side's reads
            drop_page_cache([*self.tier_dir.glob("*/*/*.page"), self.raw_path])

    def run(self, phase: str, side: str) -> int:
        if side == "ours" and phase == "offload":
            before = self.disk.stats.bytes_stored
            for part in self.batches():
                self.disk.store(self.keys[part.start : part.stop], self.src_views[part.start : part.stop], _ignore)
            self.disk.wait()
            return self.disk.stats.bytes_stored - before
        if side == "ours":
            got = 0
            for part in self.batches():
                got += self.disk.fetch(  # rows lent, as the connector's host rows are: read straight into them
                    self.keys[part.start : part.stop], self.dst_views[part.start : part.stop], done=_ignore
                )
            if got != self.num_pages:
                raise RuntimeError(f"disk tier: {got} of {self.num_pages} stored pages read back")
            return got * self.row_bytes
        moved = 0
        if phase == "offload":
            with open(self.raw_path, "wb", buffering=0) as f:
                for header, view in zip(self.headers, self.src_views, strict=True):
                    f.write(header)
                    moved += f.write(view)
            return moved
        header_buf = bytearray(HEADER_SIZE)
        with open(self.raw_path, "rb", buffering=0) as f:
            for view in self.dst_views:
                f.readinto(header_buf)
                moved += f.readinto(view)
        return moved

    def end(self) -> None:
        self.disk.reset()
        self.raw_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.disk.shutdown()


def _ignore(i: int) -> None:
    """A `done` callback that keeps nothing alive (the case owns the rows)."""
