"""`Tiering`: the connectors (one per replica) and KV events of a `PagedKVCacheManager`.

Every replica whose pages can go down the tiers by hash (one group, or every token group full attention,
with or without recurrent state) reaches them through one port, a `ReplicaTiers` set as its `tier_link`:
its first `alloc` asks it for the pages (and state checkpoints) after the device hit, its `step` queues
the runs it committed (`hooks.offloads`), and a failed copy restarts the requests holding the page
(`restart_holders`). Tiering calls the connectors at the points of the per-step order of Modular MAX's
KV connector: `before_forward` (run the device copies `load` staged during `alloc`, then start offloads)
from `runtime_inputs`, `before_step` (wait for offloads) and `after_step` (publish events) around `step`;
with no connector and no event listener (`active` False) the manager makes none of these calls.

Pages go by (group, hash); state checkpoints go as images under their keys, in a second connector that
takes a third of the host rows and of the disk cap (`STATE_TIER_SHARE`). A hybrid with windowed groups
(sliding window, chunked local, sinks) gets host rows for swap preemption only, with
``kv_connector="local"``: none of its pages goes down the tiers by hash. Models with recurrent state are
never swapped (they resume from checkpoints).

`alloc` does no tensor work: a page found below is committed as a hit at
once, but its bytes reach the device page only at `complete_loads`, which
every reader of device pages here runs first (`before_forward`, `sync`,
`close`, `reset`, offload pushes, and the connector's swap and `flush`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.core.events import AllBlocksCleared, KVEventBatch, KVEventQueue
from pagedkv.core.memory import compute_num_host_blocks
from pagedkv.core.replica import ReplicaBookkeeping
from pagedkv.manager.tier_link import PageEvents, ReplicaTiers, state_events
from pagedkv.offload.tier_stats import TierStats
from pagedkv.params.kv import KVConnectorType
from pagedkv.params.multi import KVCacheParamInterface

__all__ = ["Tiering"]

Listener = Callable[[KVEventBatch], None]
TRACKED_KEYS = 1 << 18  # tier keys a model of several attention groups maps back to hashes for its events


class Tiering:
    """Connectors and event queues of every replica; inert with ``kv_connector`` null and no listener."""

    def __init__(
        self,
        params: KVCacheParamInterface,
        managers: Sequence[ReplicaBookkeeping],
        buffers: Sequence[Any],
        host_pages: int,
    ) -> None:
        self.managers = list(managers)
        self.queues = [KVEventQueue() for _ in managers]
        self.listeners: list[Listener] = []
        self.seq = 0
        self.connectors: list[Any] = []
        self.links: list[ReplicaTiers] = []  # one per replica whose pages go down the tiers by hash
        self.state_connectors: list[Any] = []  # the links' state checkpoint connectors
        self.swap_spaces: list[Any] = []  # one `SwapSpace` per replica when a host tier exists
        self.active = False  # connectors or listeners: False means the per-step calls have nothing to do
        kind = params.kv_connector
        if kind in (None, KVConnectorType.null):
            return
        stateful = any(bm.states is not None for bm in managers)
        by_hash = all(bm.tiers_by_hash for bm in managers)
        if not by_hash and kind is not KVConnectorType.local:
            raise ValueError(f"kv_connector={kind.value}: tiers below the device keep pages by hash for models "
                             "whose attention is all full attention (recurrent state layers included); a model "
                             "with sliding-window, chunked or sink layers takes kv_connector=local, host rows "
                             "for swap preemption")  # fmt: skip
        if not host_pages and kind in (KVConnectorType.local, KVConnectorType.tiered):
            host_pages = compute_num_host_blocks(params)
        elif not host_pages and params.host_kvcache_swap_space_gb is not None:
            host_pages = compute_num_host_blocks(params, any_connector=True)
        from pagedkv.offload.factory import STATE_TIER_SHARE, create_connector, create_state_connector
        from pagedkv.offload.transfer import PageMover

        config = params.kv_connector_config
        for bm, buffer, queue in zip(managers, buffers, self.queues, strict=True):
            mover = PageMover(buffer)
            page_rows, disk = host_pages, None
            images = None
            if bm.states is not None:  # a third for checkpoint images
                image_bytes = sum(int(a.shape[1]) for a in buffer.state_arenas) + (
                    mover.row_bytes * len(bm.tier_groups.decoder)
                )
                image_rows = host_pages * mover.row_bytes // STATE_TIER_SHARE // image_bytes
                page_rows = host_pages - -(-image_rows * image_bytes // mover.row_bytes)
                if config is not None and config.disk_offload_dir is not None:
                    disk = config.disk_max_bytes - config.disk_max_bytes // STATE_TIER_SHARE
                images = create_state_connector(params, buffer, mover, image_rows, len(bm.tier_groups.decoder),
                                                emit=state_events(queue.emit, bm.states.groups))  # fmt: skip
            several = by_hash and len(bm.tier_groups.cacheable) > 1
            events = PageEvents(queue.emit, TRACKED_KEYS) if several else None
            connector = create_connector(params, buffer, page_rows, emit=events or queue.emit, mover=mover,
                                         disk_bytes=disk)  # fmt: skip
            if by_hash:  # (otherwise its host rows serve swap preemption only)
                states, image_mover = images or (None, None)
                link = ReplicaTiers(bm, connector, states, image_mover, events)
                self.state_connectors.extend(link.connectors[1:])
                bm.tier_link = link
                bm.hooks.offloads = []
                self.links.append(link)
            self.connectors.append(connector)
        self.active = True
        if self.connectors[0].num_host_blocks and not stateful:
            from pagedkv.offload.swap_space import SwapSpace

            self.swap_spaces = [SwapSpace(c) for c in self.connectors]

    @property
    def host_pages(self) -> int:
        """Host rows per replica (0 without a host tier)."""
        return self.connectors[0].num_host_blocks if self.connectors else 0

    # ----------------------------------------------------------------- per-step calls
    def before_forward(self) -> None:
        """Pages `alloc` loaded are in their device pages; pages committed since the last call start
        moving down the tiers. Raises `LoadCopyError` if a device copy failed (see `complete_loads`)."""
        self.complete_loads()
        self._push()

    def complete_loads(self) -> None:
        """Run every replica's staged loads (`KVConnector.complete_loads`): after this, every page `alloc`
        took from a tier holds its bytes. Call before reading device pages outside `runtime_inputs`.

        A failed copy raises `LoadCopyError` after its pages left the device prefix cache (no later
        request hits them) and every request holding one was rolled back (`restart_holders`): every table and context is consistent, and the next `alloc`
        of each such request computes (or loads again) what it lost.
        """
        failed: Exception | None = None
        for connector in self.all_connectors:  # every replica's copies run (and unpin), even after a failure
            try:
                connector.complete_loads()
            except Exception as error:  # noqa: BLE001 - re-raised below, after the other replicas
                failed = failed or error
        for link in self.links:
            link.loads_done()
        if failed is not None:
            raise failed

    @property
    def all_connectors(self) -> list[Any]:
        """Every replica's page connector, then the state checkpoint connectors."""
        return [*self.connectors, *self.state_connectors]

    def stats(self, replica_idx: int) -> dict[str, TierStats]:
        """Replica `replica_idx`'s tier counters by name ("host", "disk", "redis"; "host_states", ... for a
        model with recurrent state's checkpoint images). Empty without tiers."""
        if not self.connectors:
            return {}
        out = dict(self.connectors[replica_idx].stats)
        link = next((x for x in self.links if x.bm is self.managers[replica_idx]), None)
        if link is not None and link.states is not None:
            out.update(link.states.stats)
        return out

    def sync(self) -> None:
        """Run staged loads, push every queued page down and wait until every tier has written it."""
        self.complete_loads()
        self._push()
        for connector in self.all_connectors:
            connector.flush()

    def _push(self) -> None:
        """Start offloading the runs `step` committed (staged loads must have run: pages are read), and the
        state checkpoints saved since the last push."""
        for link in self.links:
            link.push()

    def push_states(self) -> None:
        """Start copying the state checkpoints saved since the last push down the tiers (at `step` and `release`,
        before an `alloc` may evict them; `before_alloc` waits for the copies)."""
        for link in self.links:
            link.push_states()

    def before_alloc(self) -> None:
        """Checkpoint images being copied down have been read: `alloc` may evict their rows and tail pages."""
        for connector in self.state_connectors:
            connector.wait_for_offloads()

    def before_step(self) -> None:
        """Offloads have read their device pages, so `alloc` may evict them again; loads staged
        without a forward since (a request released before it) have run, so no host row stays pinned."""
        for connector in self.all_connectors:
            connector.complete_loads()
            connector.wait_for_offloads()

    def after_step(self) -> None:
        """Publish each replica's events since the last call as one numbered batch."""
        for rank, queue in enumerate(self.queues):
            events = queue.drain()
            if events and self.listeners:
                batch = KVEventBatch(self.seq, time.time(), events, rank)
                self.seq += 1
                for listener in list(self.listeners):
                    listener(batch)

    # ----------------------------------------------------------------- events
    def add_listener(self, listener: Listener) -> None:
        """Call `listener(batch)` for every event batch from now on (device events switch on)."""
        self.listeners.append(listener)
        self.active = True
        for bm, queue in zip(self.managers, self.queues, strict=True):  # (every group, and state checkpoints)
            bm.set_event_sink(queue.emit)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener`; device events switch off with the last one."""
        self.listeners.remove(listener)
        self.active = bool(self.connectors or self.listeners)
        if not self.listeners:
            for bm in self.managers:
                bm.set_event_sink(None)

    # ----------------------------------------------------------------- maintenance
    def reset(self) -> None:
        """Forget every tier's pages (staged loads run first); tell listeners when nothing stays cached."""
        for connector in self.all_connectors:
            connector.reset_prefix_cache()  # (`flush` runs staged loads before the host rows are cleared)
        for bm, queue in zip(self.managers, self.queues, strict=True):
            if self.listeners and bm.pool.num_cached == 0 and not bm.states:
                queue.drain()  # the individual removals are subsumed
                queue.emit(AllBlocksCleared())
        self.after_step()

    def close(self) -> None:
        """Run staged loads, finish every transfer, stop the connectors' threads, detach them from the managers."""
        try:
            self.sync()
        finally:  # (a failed staged copy still stops the threads and detaches the tiers)
            for connector in self.state_connectors:
                connector.shutdown()
            for bm, connector in zip(self.managers, self.connectors, strict=False):
                connector.shutdown()
                bm.hooks.offloads = None
            for link in self.links:
                link.detach()
            self.connectors, self.state_connectors, self.links = [], [], []
            self.swap_spaces = []
            self.active = bool(self.listeners)
