"""KV cache events (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and the hooks that raise them, pure Python.

The bookkeeping and the tiers `emit` events into a `KVEventQueue`;
`PagedKVCacheManager` drains it once per `step` into a numbered
`KVEventBatch` for its listeners (callbacks, the ZMQ publisher). Hashes
are the prefix-cache keys as stored: 32- or 16-byte digests, or an int
(`sha256_64`). `medium` names the tier: "GPU" (the device pool, whatever
the device), "CPU" (host tier), "DISK", "REDIS".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.hashing import BlockHash

__all__ = [
    "AllBlocksCleared", "BlockHooks", "BlockRemoved", "BlockStored", "EventSink", "KVEvent", "KVEventBatch",
    "KVEventQueue",
]  # fmt: skip


@dataclass(frozen=True)
class BlockStored:
    """Pages that became hittable in `medium`, in prefix order.

    `parent_block_hash` is the key of the page before the first (None at a
    prefix start). `token_ids` are the pages' tokens (empty for tier copies,
    whose tokens the device event already gave).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = "GPU"
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None  # vLLM's `KVCacheSpecKind` value ("full_attention", "mamba", ...)


@dataclass(frozen=True)
class BlockRemoved:
    """Pages no longer hittable in `medium`."""

    block_hashes: list[BlockHash]
    medium: str = "GPU"
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page of every medium of this cache was forgotten."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one step: `seq` increases by one per batch (a gap means lost events)."""

    seq: int
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int = 0


@dataclass
class KVEventQueue:
    """Events in emission order, thread-safe (tiers emit from their transfer threads)."""

    _events: list[KVEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def emit(self, event: KVEvent) -> None:
        """Append one event."""
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[KVEvent]:
        """Every event since the last drain, oldest first (the queue is then empty)."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def __len__(self) -> int:
        return len(self._events)


EventSink = Callable[[KVEvent], None]


@dataclass
class BlockHooks:
    """Attributes:
    emit: receives `BlockStored` for pages committed on the device.
    offloads: when a list, `step` appends ``(parent hash, hashes, group)`` for each run of newly
        committed pages, for the tiers to copy.
    """

    emit: EventSink | None = None
    offloads: list[tuple[BlockHash | None, list[BlockHash], int]] | None = None

    def committed(
        self, hashes: list[BlockHash], first: int, stop: int, tokens: Any, page_size: int, group: int = 0,
        kind: str | None = None,
    ) -> None:  # fmt: skip
        """Pages [first, stop) of a request were committed in `group` (`tokens`: the request's token array;
        `kind`: the group's spec kind, given for models of several groups)."""
        parent = hashes[first - 1] if first else None
        if self.offloads is not None:
            self.offloads.append((parent, hashes[first:stop], group))
        if self.emit is not None:
            ids = [int(t) for t in tokens[first * page_size : stop * page_size]]
            self.emit(BlockStored(hashes[first:stop], parent, ids, page_size, "GPU", group, kind))
