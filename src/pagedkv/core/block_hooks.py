"""`BlockHooks`: what a block manager tells the tiers below and the event listeners (all optional).

Pure Python: the tiers and publishers plug in callables, so the bookkeeping
never imports them (or torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.core.events import BlockStored, EventSink
from pagedkv.core.hashing import BlockHash

__all__ = ["BlockHooks", "Loader"]

# loader(device pages, their prefix hashes) -> how many leading pages it filled from a tier
Loader = Callable[[Sequence[int], Sequence[BlockHash]], int]


@dataclass
class BlockHooks:
    """Attributes:
    loader: fills new pages from the tiers during `alloc` (after the device prefix cache).
    emit: receives `BlockStored` for pages committed on the device.
    offloads: when a list, `step` appends ``(parent hash, hashes)`` for each run of newly
        committed pages, for the tiers to copy.
    """

    loader: Loader | None = None
    emit: EventSink | None = None
    offloads: list[tuple[BlockHash | None, list[BlockHash]]] | None = None

    def committed(self, hashes: list[BlockHash], first: int, stop: int, tokens: Any, page_size: int) -> None:
        """Pages [first, stop) of a request were committed (`tokens`: the request's token array)."""
        parent = hashes[first - 1] if first else None
        if self.offloads is not None:
            self.offloads.append((parent, hashes[first:stop]))
        if self.emit is not None:
            ids = [int(t) for t in tokens[first * page_size : stop * page_size]]
            self.emit(BlockStored(hashes[first:stop], parent, ids, page_size))
