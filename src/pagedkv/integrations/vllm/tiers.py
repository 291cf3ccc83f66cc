"""`TierSet`: the disk and / or Redis tier of one layout fingerprint, read and written by vLLM block.

The tiers are pagedkv's own (`pagedkv.offload.disk.DiskTier`,
`pagedkv.offload.redis_tier.RedisTier`): the checked page format, HMAC
signatures, one file per page or one Redis value per page, and their outage
rules (an I/O error is counted and logged once, and reads as a miss, never an
exception). With both tiers a page is read from the disk first, then Redis, and
written to both.

Saves: `save` gathers the blocks into a host staging tensor (synchronously: the
blocks may be reused as soon as it returns), then hands the rows to the tiers,
whose threads write them in the background; the staging tensor lives until the
last tier is done with it. Each staging row keeps `HEADER_SIZE` bytes of room
before the block's bytes: the last tier (Redis when there are both) gets the
rows framed (`LowerTier.store(framed=True)`: it writes the header into the room
and sends or writes the page as one buffer, no join), the others the payload
views. At most `max_pending_bytes` of rows wait for their writes; a save beyond
that first waits for the tiers (back pressure).

Loads: on a host KV cache whose layer blocks are runs of bytes (vLLM's CPU
layouts), the tiers read each page straight into the block's layer slices
(`BlockMover.block_parts`: the row's parts) and check the checksum or HMAC over
them in place: one pass over the bytes, no staging. Elsewhere (a GPU cache) the
pages go through a staging tensor and `BlockMover.scatter`. A page that fails its
check may leave bytes in its block; the block is reported failed and recomputed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pagedkv.integrations.vllm.blocks import BlockMover
from pagedkv.offload.format import HEADER_SIZE
from pagedkv.offload.tier import LentRows, LowerTier, Row
from pagedkv.offload.tier_stats import TierStats
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["TierSet"]


class TierSet:
    """The lower tiers of `config` for pages of `row_bytes` under `fingerprint`. Thread-safe."""

    def __init__(
        self, config: KVConnectorConfig, row_bytes: int, fingerprint: bytes, hash_algo: str, *,
        max_pending_bytes: int = 2**31, pin_memory: bool = False,
    ) -> None:  # fmt: skip
        self.row_bytes = row_bytes
        self.tiers: list[LowerTier] = []
        if config.disk_offload_dir is not None:
            from pagedkv.offload.disk import DiskTier

            self.tiers.append(DiskTier(config.disk_offload_dir, row_bytes, config.disk_max_bytes, fingerprint,
                                       hash_algo, threads=config.io_threads, mac_key=config.mac_key,
                                       timeout_s=config.disk_timeout_s))  # fmt: skip
        if config.redis_url is not None:
            from pagedkv.offload.redis_tier import RedisTier

            self.tiers.append(RedisTier(config, row_bytes, fingerprint, hash_algo))
        self.max_pending_bytes = max(row_bytes, max_pending_bytes)
        self.pin_memory = pin_memory
        self._pending = 0  # staging bytes handed to the tiers and not released yet
        self._cond = threading.Condition()
        self._free: list[torch.Tensor] = []  # save staging buffers whose writes are done, for reuse
        self._local = threading.local()  # each loading thread's staging buffer

    @property
    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters by name ("disk", "redis")."""
        return {tier.stats.name: tier.stats for tier in self.tiers}

    def _new(self, n: int, room: int = 0) -> torch.Tensor:
        rows = torch.empty((n, room + self.row_bytes), dtype=torch.uint8, pin_memory=self.pin_memory)  # [n, room+row]
        rows.fill_(0)  # fault the pages in now, once: a reused buffer's copies then run at memcpy speed
        return rows

    def _views(self, rows: torch.Tensor, n: int) -> list[memoryview]:
        array = rows.numpy()
        return [memoryview(array[i]) for i in range(n)]

    def _load_staging(self, n: int) -> torch.Tensor:
        """This thread's load buffer, grown to `n` rows (kept: the next load reuses it)."""
        rows: torch.Tensor | None = getattr(self._local, "rows", None)
        if rows is None or rows.shape[0] < n:
            rows = self._local.rows = self._new(n)
        return rows

    def _moved(self, rows: torch.Tensor, valid: int) -> torch.Tensor:
        """A new load buffer for this thread holding the first `valid` rows of `rows` (which a tier may still
        write into past them: it is dropped, the tier's views keep it alive)."""
        fresh = self._local.rows = self._new(rows.shape[0])
        fresh[:valid].copy_(rows[:valid])
        return fresh

    def _save_staging(self, n: int) -> torch.Tensor:
        """A free save buffer of at least `n` rows (reused once its writes are done), else a new one."""
        with self._cond:
            for i, rows in enumerate(self._free):
                if rows.shape[0] >= n:
                    return self._free.pop(i)
        return self._new(n, HEADER_SIZE)

    # ----------------------------------------------------------------- reads
    def leading_hits(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some tier holds (no bytes read: a page counted here may still be
        missing or refused at load time, which the load then reports). 0 while every tier is down."""
        found = [False] * len(keys)
        for tier in self.tiers:
            rest = [i for i, there in enumerate(found) if not there]
            if not rest:
                break
            for i, there in zip(rest, tier.contains([keys[i] for i in rest]), strict=True):
                found[i] = there
        return next((i for i, there in enumerate(found) if not there), len(found))

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int], mover: BlockMover) -> int:
        """Read the pages of the longest prefix of `keys` the tiers hold, checked (header, layout,
        checksum or HMAC), and copy them into blocks `block_ids[:count]`; returns that count.
        Each tier is asked for the rest whenever another stops, so a prefix split over the disk
        and Redis loads whole. Never raises for a missing, refused or unreachable page."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if not keys:
            return 0
        parts = mover.block_parts(block_ids)  # straight into the KV blocks, or through staging rows
        rows: torch.Tensor | None = None
        views: list[Row]
        if parts is None:
            rows = self._load_staging(len(keys))
            views = list(self._views(rows, len(keys)))
        else:
            views = list(parts)
        found = 0
        progress = True
        while found < len(keys) and progress:
            progress = False
            for tier in self.tiers:
                if rows is None:  # the KV cache's own blocks: nothing may write into them after the call
                    got = tier.fetch(keys[found:], views[found:])
                else:  # this thread's staging rows are lent (read straight into them)
                    lent = LentRows()
                    got = tier.fetch(keys[found:], views[found:], done=lent.done)
                    if lent.out(len(keys) - found):  # a read the tier gave up on may still write: the buffer is
                        rows = self._moved(rows, found + got)  # left to it; this load and the next use another
                        views = list(self._views(rows, len(keys)))
                tier.stats.add(lookups=len(keys) - found, pages_loaded=got, bytes_loaded=got * self.row_bytes)
                found += got
                progress = progress or got > 0
                if found == len(keys):
                    break
        if found and rows is not None:
            mover.scatter(rows[:found], block_ids[:found])
        return found

    # ----------------------------------------------------------------- writes
    def save(self, keys: Sequence[bytes], block_ids: Sequence[int], mover: BlockMover) -> None:
        """Copy blocks `block_ids` into staging rows now, and have every tier store them under `keys`
        in the background (`wait` waits for the writes). Pages a tier holds already are skipped."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys but {len(block_ids)} block ids")
        if not keys or not self.tiers:
            return
        size = len(keys) * self.row_bytes
        with self._cond:
            over = self._pending > 0 and self._pending + size > self.max_pending_bytes
        if over:
            self.wait()  # back pressure: the tiers write slower than the engine computes
        with self._cond:
            self._pending += size
        rows = self._save_staging(len(keys))  # [>= n, HEADER_SIZE + row_bytes]
        try:
            mover.gather(block_ids, rows[: len(keys), HEADER_SIZE:])
        except BaseException:
            self._release(size, rows)
            raise
        pages = self._views(rows, len(keys))  # header room + payload
        payloads = [page[HEADER_SIZE:] for page in pages]
        remaining = [len(self.tiers) * len(keys)]  # `done` calls still to come

        def done(i: int) -> None:  # `rows` goes back to the pool once every tier read every row
            with self._cond:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._release(size, rows)

        for tier in self.tiers[:-1]:
            tier.store(keys, payloads, done)
        self.tiers[-1].store(keys, pages, done, framed=True)

    def _release(self, size: int, rows: torch.Tensor) -> None:
        with self._cond:
            self._pending -= size
            if sum(r.numel() for r in self._free) + rows.numel() <= self.max_pending_bytes:
                self._free.append(rows)  # kept for the next save (at most max_pending_bytes of them)
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every write issued so far has finished (or failed and been counted)."""
        for tier in self.tiers:
            tier.wait()

    def shutdown(self) -> None:
        """Finish pending writes; release threads and connections."""
        for tier in self.tiers:
            tier.shutdown()
