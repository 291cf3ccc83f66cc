"""`ReplicaTiers`: the one port through which a replica's bookkeeping reaches the tiers below the device.

A replica whose token groups are all full attention (every page of a prefix
stays, so a page is worth keeping below by its hash: a `BlockManager`, or a
`KVCacheCoordinator` with or without recurrent state groups) asks these at a
request's first `alloc` (`core.tier_hits.TierLink`):

- pages go through `pages` (a `KVConnector` over the arena rows): group g's
  page of a prefix is stored under `tier_key(hash, g)` (the hash itself when
  the model has one cacheable group, as a single-group model's pages are);
- state checkpoints go through `states` (a `KVConnector` over
  `StateImageMover`): one image per checkpoint, its state row and its tail
  pages, under the checkpoint key; checkpoints saved on the device are
  pushed down with the pages a step committed (`push`).

Both connectors keep the checked page format, HMAC signatures and layout
fingerprints of every tier (the images have a fingerprint of their own).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.core.events import BlockRemoved, BlockStored, EventSink, KVEvent
from pagedkv.core.hashing import BlockHash
from pagedkv.core.replica import ReplicaBookkeeping
from pagedkv.offload.connector import KVConnector
from pagedkv.offload.format import key_bytes
from pagedkv.offload.state_images import StateImageMover

__all__ = ["ReplicaTiers", "state_events", "tier_key"]


def tier_key(block_hash: BlockHash, group: int, groups: int) -> bytes:
    """The key group `group`'s page of `block_hash` is stored under below the device: the hash itself for a
    model of one cacheable group, else a digest of the group and the hash (as long as the hash)."""
    raw = key_bytes(block_hash)
    if groups <= 1:
        return raw
    return hashlib.sha256(b"pagedkv-group\x00" + group.to_bytes(4, "little") + raw).digest()[: len(raw)]


class PageEvents:
    """An event sink for the page connector of a model with several cacheable groups: its events name tier keys,
    which this maps back to (prefix hash, group), one event per group, as the device's events name them. Keys
    are remembered when pages go down or come back (`remember`), at most `capacity` of them (oldest forgotten
    first; a removal of a forgotten key is not reported)."""

    def __init__(self, emit: EventSink, capacity: int) -> None:
        self.emit = emit
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[bytes, tuple[BlockHash, int, str]] = OrderedDict()

    def remember(self, key: bytes, block_hash: BlockHash, group: int, kind: str) -> None:
        self.keys[key] = (block_hash, group, kind)
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def __call__(self, event: KVEvent) -> None:
        if not isinstance(event, BlockStored | BlockRemoved):
            self.emit(event)
            return
        by_group: dict[tuple[int, str], list[BlockHash]] = {}
        for key in event.block_hashes:
            known = self.keys.get(key_bytes(key))
            if known is not None:
                by_group.setdefault((known[1], known[2]), []).append(known[0])
        parent = None
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            known = self.keys.get(key_bytes(event.parent_block_hash))
            parent = None if known is None else known[0]
        for (group, kind), hashes in by_group.items():
            if isinstance(event, BlockStored):
                self.emit(BlockStored(hashes, parent, event.token_ids, event.block_size, event.medium, group, kind))
            else:
                self.emit(BlockRemoved(hashes, event.medium, group))


def state_events(emit: EventSink, groups: Sequence[int]) -> EventSink:
    """An event sink for the state connector: each event repeated for every state group, kind "mamba"."""

    def relay(event: KVEvent) -> None:
        for g in groups:
            if isinstance(event, BlockStored):
                emit(BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                 event.medium, g, "mamba"))  # fmt: skip
            elif isinstance(event, BlockRemoved):
                emit(BlockRemoved(event.block_hashes, event.medium, g))
            else:
                emit(event)
                return

    return relay


class ReplicaTiers:
    """`TierLink` of one replica's bookkeeping over `pages` (and `states`, for a model with recurrent state)."""

    def __init__(
        self, bm: ReplicaBookkeeping, pages: KVConnector, states: KVConnector | None, images: StateImageMover | None,
        events: PageEvents | None = None,
    ) -> None:  # fmt: skip
        self.bm = bm
        self.events = events  # (several cacheable groups: tier keys back to hashes and groups)
        self.pages = pages
        self.states = states
        self.images = images
        self.groups = list(bm.tier_groups.cacheable)
        self._loaded: dict[bytes, tuple[BlockHash, int]] = {}  # tier key -> (hash, group) of staged page loads
        pages.on_failed_loads = self._forget_unloaded
        if states is not None:
            assert bm.states is not None
            bm.states.saved = []
            states.on_failed_loads = self._forget_unloaded_states

    def key(self, block_hash: BlockHash, group: int) -> bytes:
        return tier_key(block_hash, group, len(self.groups))

    def _flat(self, keys: Sequence[BlockHash]) -> list[bytes]:
        return [self.key(h, g) for h in keys for g in self.groups]

    # ----------------------------------------------------------------- TierLink
    def held_pages(self, keys: Sequence[BlockHash]) -> int:
        if not self.groups:
            return len(keys)
        found, n = self.pages.contains(self._flat(keys)), len(self.groups)
        return next((i for i in range(len(keys)) if not all(found[i * n : (i + 1) * n])), len(keys))

    def load_pages(self, tables: Sequence[Sequence[int]], keys: Sequence[BlockHash]) -> int:
        if not self.groups or not keys:
            return len(keys)
        ids = [int(tables[j][i]) for i in range(len(keys)) for j in range(len(self.groups))]
        flat = self._flat(keys)
        if self.events is not None:
            self._remember(keys)
        got = self.pages.load(ids, flat)
        for i, key in enumerate(flat[:got]):
            self._loaded[key] = (keys[i // len(self.groups)], self.groups[i % len(self.groups)])
        return got // len(self.groups)

    def _remember(self, hashes: Sequence[BlockHash], group: int | None = None, parent: BlockHash | None = None) -> None:
        assert self.events is not None
        kinds = {g.group: g.kind for g in self.bm.groups}
        for g in self.groups if group is None else [group]:
            for h in [*hashes, *([] if parent is None else [parent])]:
                self.events.remember(self.key(h, g), h, g, kinds[g])

    def held_checkpoints(self, keys: Sequence[bytes]) -> list[bool]:
        return self.states.contains(keys) if self.states is not None else [False] * len(keys)

    def load_checkpoint(self, key: bytes, row: int, tail_pages: Sequence[int], parent: BlockHash | None) -> bool:
        if self.states is None or self.images is None:
            return False
        self.images.bind(row, tail_pages)
        return self.states.load([row], [key]) == 1

    # ----------------------------------------------------------------- tensor side
    def loads_done(self) -> None:
        """Every staged load has run (`Tiering.complete_loads`): forget which keys they were."""
        self._loaded.clear()

    def detach(self) -> None:
        """Stop serving the coordinator (the tiers are shut down)."""
        self.bm.tier_link = None
        if self.bm.states is not None:
            self.bm.states.saved = None

    def push(self) -> None:
        """Start copying what `step` committed down the tiers: each run of pages, then `push_states`."""
        bm = self.bm
        runs, bm.hooks.offloads = bm.hooks.offloads or [], []
        for parent, hashes, group in runs:
            ids = []
            for block_hash in hashes:  # stop at the first page evicted since its commit: no gap
                page = bm.pool.cached_page(block_hash, group)
                if page is None:
                    break
                ids.append(page)
            if ids:
                if self.events is not None:
                    self._remember(hashes[: len(ids)], group, parent)
                up = None if parent is None else self.key(parent, group)
                self.pages.offload(ids, [self.key(h, group) for h in hashes[: len(ids)]], up)
        self.push_states()

    def push_states(self) -> None:
        """Start copying each checkpoint saved since the last push and still kept down the tiers (its state row
        and tail pages are read on the transfer thread: wait for it before an alloc may evict them)."""
        states = self.bm.states
        if self.states is None or self.images is None or states is None or not states.saved:
            return
        saved, states.saved = states.saved, []
        for entry in saved:
            if states.is_current(entry):
                image = self.images.run_id(entry.run[0]) if entry.run else entry.row
                self.images.bind(image, entry.pages, entry.run)
                head = None if isinstance(entry.parent, tuple) else entry.parent
                self.states.offload([image], [entry.key], head)  # type: ignore[arg-type]

    def _forget_unloaded(self, pages: list[int], keys: list[BlockHash]) -> None:
        """Pages whose copy failed leave the device prefix cache (those it still names for the hash they
        were loaded for), and every request holding one restarts (`ReplicaBookkeeping.restart_holders`)."""
        pool, bad = self.bm.pool, []
        for page, key in zip(pages, keys, strict=True):
            block_hash, group = self._loaded.get(key_bytes(key), (None, 0))
            if block_hash is not None and pool.cached_page(block_hash, group) == page:
                bad.append(page)
        pool.uncache(bad)
        self.bm.restart_holders(bad)

    def _forget_unloaded_states(self, rows: list[int], keys: list[BlockHash]) -> None:
        """Checkpoint images whose copy into a live state row (and its tail pages) failed: the request
        resuming from one restarts (`ReplicaBookkeeping.restart_holders`)."""
        self.bm.restart_holders((), rows)

    @property
    def connectors(self) -> list[KVConnector]:
        """The page connector, and the state connector when there is one."""
        return [self.pages, *([self.states] if self.states is not None else [])]
