"""`KVConnector`: one replica's tiers below the device, after the KV connector of Modular's MAX.

    device pages ──offload──▶ host rows (LRU) ──write-through──▶ disk / Redis
                 ◀──load────             ◀──promote on a hit───

Per engine step, in this order (`PagedKVCacheManager` drives it through `Tiering`):

1. `load` (inside `alloc`, bookkeeping only): the longest prefix of the asked hashes found in
   host, then the lower tiers, whose reads land in host rows (or a staging buffer) checked
   (header, layout, checksum), so the count it returns is final. No device page is touched:
   the copies are staged (`StagedLoads`), their rows pinned.
2. `complete_loads` (start of `runtime_inputs`, and before anything else reads or writes
   device pages): the staged copies run, the rows are unpinned.
3. `offload` (in `runtime_inputs`): pages `step` committed go to host rows
   on a transfer thread while the model runs, then to the lower tiers.
4. `wait_for_offloads` (start of `step`): device pages are no longer read,
   so the next `alloc` may evict them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedkv.core.events import BlockRemoved, BlockStored, EventSink
from pagedkv.core.hashing import BlockHash
from pagedkv.offload.format import key_bytes
from pagedkv.offload.host import HostTier
from pagedkv.offload.staged_loads import FailedLoads, LoadCopyError, StagedCopy, StagedLoads
from pagedkv.offload.tier import LentRows, LowerTier
from pagedkv.offload.tier_stats import TierStats
from pagedkv.offload.transfer import RowMover

__all__ = ["KVConnector", "LoadCopyError"]


class KVConnector:
    """Host tier (optional) and lower tiers of one replica, over `mover`'s page rows."""

    supported_hash_algos = frozenset({"sha256", "sha256_64", "xxh3_128"})

    def __init__(
        self,
        name: str,
        mover: RowMover,
        *,
        host_pages: int,
        lower: Sequence[LowerTier] = (),
        page_size: int,
        emit: EventSink | None = None,
    ) -> None:
        self.name = name
        self.mover = mover
        self.page_size = page_size
        self.host = HostTier(host_pages, mover.row_bytes, pin_memory=mover.cuda) if host_pages else None
        self.lower = list(lower)
        self._emit = emit
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-offload")
        self._pending: list[Future[None]] = []
        # copies `load` promised, not run yet (`len`, `.pages`); unpin is called with host rows only
        self.staged = StagedLoads(lambda rows: self.host.index.unpin(rows))  # type: ignore[union-attr]
        self.on_failed_loads: FailedLoads | None = None  # told before `complete_loads` raises LoadCopyError

    # ----------------------------------------------------------------- counters
    @property
    def tiers(self) -> list[HostTier | LowerTier]:
        """Every tier, top down."""
        return [*([self.host] if self.host else []), *self.lower]

    @property
    def stats(self) -> dict[str, TierStats]:
        """Each tier's counters by name ("host", "disk", "redis")."""
        return {tier.stats.name: tier.stats for tier in self.tiers}

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_pages if self.host else 0

    @property
    def num_used_host_blocks(self) -> int:
        return self.host.num_used_pages if self.host else 0

    @property
    def num_disk_blocks(self) -> int:
        return sum(t.num_pages for t in self.lower if t.name == "disk")

    @property
    def num_used_disk_blocks(self) -> int:
        return sum(t.num_used_pages for t in self.lower if t.name == "disk")

    # ----------------------------------------------------------------- load
    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> int:
        """Stage page `hashes[i]` for device page `block_ids[i]` over the longest prefix the tiers hold;
        returns its length (the `TierLink.load_pages` contract: those pages will be filled).

        No device page is read or written: host rows found are pinned, lower-tier pages are fetched
        and checked into (pinned) host rows or a staging buffer, and one copy per page is staged;
        `complete_loads` runs them. Waits for offloads in flight (their host rows are then complete).
        Never raises for a tier failure (that page and the rest count as misses); raises
        ValueError / TypeError, changing nothing, for mismatched lengths, bad page ids or hashes."""
        self._check_pages(block_ids, hashes)
        keys = [key_bytes(h) for h in hashes]
        if not keys:
            return 0
        self.wait_for_offloads()  # a page offloaded this step is in its row and the lower tiers' queues
        slots = self._host_hits(keys)  # >= 0: host rows; < 0: row -1 - s of `staging`
        staging: torch.Tensor | None = None
        for tier in self.lower:
            found = len(slots)
            if found == len(keys):
                break
            rest = keys[found:]
            reserved = self._reserve(rest)
            if reserved is None:
                if staging is None:
                    staging = torch.empty((len(keys), self.mover.row_bytes), dtype=torch.uint8)  # [n, row]
                array = staging.numpy()
                views = [memoryview(array[found + i]) for i in range(len(rest))]
            else:
                views = [self.host.row(s) for s in reserved]  # type: ignore[union-attr]
            t0 = time.perf_counter()
            if reserved is None:  # (staging rows are reused by the next tier: the tier may not write them late)
                got = tier.fetch(rest, views)
            else:  # host rows are lent: read straight into them, each unpinned once the tier hands it back
                lent = LentRows(self._unpin_late(reserved))
                got = tier.fetch(rest, views, done=lent.done)
            tier.stats.add(lookups=len(rest), pages_loaded=got, bytes_loaded=got * self.mover.row_bytes)
            tier.stats.observe("load", time.perf_counter() - t0)
            if reserved is None:
                slots.extend(-1 - (found + i) for i in range(got))
            else:
                self._promoted(rest, reserved, got, lent.out(len(rest)))
                slots.extend(reserved[:got])
            if got < len(rest):  # a miss or a refused page ends the prefix
                break
        for bid, block_hash, s in zip(block_ids, hashes, slots, strict=False):  # one staged copy per page found
            row, source = (s, None) if s >= 0 else (-1 - s, staging)
            self.staged.add(StagedCopy(bid, row, source, block_hash))
        return len(slots)

    def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether some tier holds each page (host index, then each lower tier for the rest); no data
        moves and no row is pinned, so a page found here may be gone (or refused) by the `load` after."""
        keys = [key_bytes(h) for h in hashes]
        found = [False] * len(keys)
        if self.host is not None:
            with self.host.index.lock:
                found = [key in self.host.index for key in keys]
        for tier in self.lower:
            rest = [i for i, there in enumerate(found) if not there]
            if not rest:
                break
            for i, there in zip(rest, tier.contains([keys[i] for i in rest]), strict=True):
                found[i] = there
        return found

    def _check_pages(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: object = None) -> None:
        """One device page id in [0, pages) per hash; hashes (and an offload's parent) are `BlockHash`es."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"got {len(block_ids)} block_ids but {len(hashes)} hashes: they pair up one to one")
        pages = self.mover.num_pages - 1  # (the last page is the null page)
        for bid in block_ids:
            if not isinstance(bid, int) or isinstance(bid, bool) or not 0 <= bid < pages:
                raise ValueError(f"block id {bid!r} must be an int in [0, {pages}) (a device page)")
        for h in (*hashes, *(() if parent is None else (parent,))):
            if not isinstance(h, bytes | int) or isinstance(h, bool):
                raise TypeError(f"hash {h!r} must be bytes or an int (a BlockHash)")

    def _host_hits(self, keys: list[bytes]) -> list[int]:
        """Host rows of the leading keys the host tier holds (pinned until copied)."""
        slots: list[int] = []
        if self.host is None:
            return slots
        index = self.host.index
        with index.lock:
            for key in keys:
                slot = index.get(key)
                if slot is None:
                    break
                index.touch(key)
                slots.append(slot)
            index.pin(slots)
        self.host.stats.add(lookups=len(keys), pages_loaded=len(slots), bytes_loaded=len(slots) * self.mover.row_bytes)
        return slots

    def _reserve(self, keys: list[bytes]) -> list[int] | None:
        """Pinned host rows for `keys`, evicting the LRU; None without a host tier or room for all."""
        host = self.host
        if host is None:
            return None
        slots: list[int] = []
        evicted: list[bytes] = []
        with host.index.lock:
            for key in keys:
                placed = None if key in host.index else host.index.insert(key)
                if placed is None:
                    break
                host.index.pin([placed[0]])  # so the next insert cannot evict this reservation
                slots.append(placed[0])
                if placed[1] is not None:
                    evicted.append(placed[1])
            if len(slots) < len(keys):  # no room for all: give the rows back, stage instead
                for key in keys[: len(slots)]:
                    host.index.remove(key)
                host.index.unpin(slots)
                slots = []
        self._evicted(evicted)
        return slots or None

    def _unpin_late(self, reserved: list[int]) -> Callable[[int], None]:
        """For `LentRows`: unpin row i when a tier hands it back after its fetch ended (a read it gave up on, which
        ended late; `_promoted` removed its key, so the row becomes free)."""
        index = self.host.index  # type: ignore[union-attr]
        return lambda i: index.unpin([reserved[i]])

    def _promoted(self, keys: list[bytes], reserved: list[int], got: int, out: set[int]) -> None:
        """Keep the host rows of the `got` pages a lower tier gave; free the rest (a row in `out`, which the tier
        has not handed back yet, at its hand-back: until then it stays pinned, so nothing reuses it)."""
        host = self.host
        assert host is not None
        with host.index.lock:
            for key in keys[got:]:
                host.index.remove(key)
            host.index.unpin(slot for i, slot in enumerate(reserved[got:], got) if i not in out)
        if got:
            host.stats.add(pages_stored=got, bytes_stored=got * self.mover.row_bytes)
            self._event(BlockStored(list(keys[:got]), None, [], self.page_size, host.medium))

    def complete_loads(self) -> int:
        """Run every staged load's device copy, then unpin its host row; returns how many pages.

        Call before anything reads or writes device pages after an `alloc`: the forward
        (`Tiering.before_forward`), swap, offloads, `flush`. Waits for offloads in flight first
        (rows they write are complete, device pages they read are read). If a copy fails, every
        staged row is still unpinned, `on_failed_loads(pages, hashes)` is told, and
        `LoadCopyError` is raised: those pages hold no valid KV.
        """
        if not len(self.staged):
            return 0
        self.wait_for_offloads()
        start = time.perf_counter()
        try:
            done = self.staged.complete(self.mover, self.host.buffer if self.host is not None else None)
        except LoadCopyError as exc:
            if self.on_failed_loads is not None:
                self.on_failed_loads(exc.pages, exc.hashes)
            raise
        if self.host is not None:
            self.host.stats.observe("load", time.perf_counter() - start)
        return done

    # ----------------------------------------------------------------- offload
    def offload(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], parent: BlockHash | None = None) -> None:
        """Copy these committed device pages into the tiers, in the background (`wait_for_offloads`).
        Pages the host tier has no free row for go straight to the lower tiers through a staging buffer.
        Raises ValueError / TypeError, changing nothing, for mismatched lengths, bad page ids or hashes.
        Staged loads run first (a page loaded since is read whole)."""
        self._check_pages(block_ids, hashes, parent)
        keys = [key_bytes(h) for h in hashes]
        if not keys:
            return
        self.complete_loads()
        new_ids, new_keys, slots, evicted, staged_ids, staged_keys = [], [], [], [], [], []
        if self.host is not None:
            index = self.host.index
            with index.lock:
                for bid, key in zip(block_ids, keys, strict=True):
                    if key in index:
                        continue
                    placed = index.insert(key)
                    if placed is None:  # every row is pinned (this batch, or writes in flight)
                        staged_ids.append(bid)
                        staged_keys.append(key)
                        continue
                    index.pin([placed[0]])  # so this batch cannot evict its own rows
                    new_ids.append(bid)
                    new_keys.append(key)
                    slots.append(placed[0])
                    if placed[1] is not None:
                        evicted.append(placed[1])
            self._evicted(evicted)
        else:
            staged_ids, staged_keys = list(block_ids), keys
        if new_keys:
            self._submit(
                self._offload_host, new_ids, new_keys, slots, key_bytes(parent) if parent is not None else None
            )
        if staged_keys and self.lower:
            rows = torch.empty((len(staged_keys), self.mover.row_bytes), dtype=torch.uint8)  # [n, row]
            self._submit(self._offload_staged, staged_ids, staged_keys, rows)
        elif staged_keys and self.host is not None:
            self.host.stats.add(skipped_writes=len(staged_keys))

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        self._pending.append(self._thread.submit(fn, *args))

    def _offload_host(self, block_ids: list[int], keys: list[bytes], slots: list[int], parent: bytes | None) -> None:
        host = self.host
        assert host is not None
        start = time.perf_counter()
        self.mover.to_rows(block_ids, host.buffer, slots)
        self.mover.sync()
        host.stats.add(pages_stored=len(keys), bytes_stored=len(keys) * self.mover.row_bytes)
        host.stats.observe("store", time.perf_counter() - start)
        self._event(BlockStored(list(keys), parent, [], self.page_size, host.medium))
        views = [host.row(s) for s in slots]

        def done(i: int) -> None:
            host.index.unpin([slots[i]])

        for tier in self.lower:
            host.index.pin(slots)  # one pin per tier's write; `done` drops it
            tier.store(keys, views, done)
        host.index.unpin(slots)  # the device copy's pin

    def _offload_staged(self, block_ids: list[int], keys: list[bytes], rows: torch.Tensor) -> None:
        self.mover.to_rows(block_ids, rows, range(len(keys)))  # type: ignore[arg-type]
        self.mover.sync()
        array = rows.numpy()
        views = [memoryview(array[i]) for i in range(len(keys))]

        def done(i: int, keep: torch.Tensor = rows) -> None:  # `rows` lives until every write is done
            del keep

        for tier in self.lower:
            tier.store(keys, views, done)

    def wait_for_loads(self) -> None:
        """`complete_loads` under its older name (kept for callers): every staged load is in its device page."""
        self.complete_loads()

    def wait_for_offloads(self) -> None:
        """Every `offload` has read its device pages (lower-tier writes may still run)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def flush(self) -> None:
        """Finish every transfer: staged loads (`complete_loads`), offloads, lower-tier writes."""
        self.complete_loads()
        self.wait_for_offloads()
        for tier in self.lower:
            tier.wait()

    # ----------------------------------------------------------------- maintenance
    def _evicted(self, keys: list[bytes]) -> None:
        if keys and self.host is not None:
            self.host.stats.add(evictions=len(keys))
            self._event(BlockRemoved(list(keys), self.host.medium))

    def _event(self, event: BlockStored | BlockRemoved) -> None:
        if self._emit is not None:
            self._emit(event)

    def reset_prefix_cache(self) -> None:
        """Forget every page of every tier (waits for transfers first)."""
        self.flush()
        if self.host is not None:
            keys: list[BlockHash] = list(self.host.index.clear())
            if keys:
                self._event(BlockRemoved(keys, self.host.medium))
        for tier in self.lower:
            tier.reset()

    def shutdown(self) -> None:
        """Finish every transfer and release threads and connections."""
        self.flush()
        self._thread.shutdown(wait=True)
        for tier in self.lower:
            tier.shutdown()
