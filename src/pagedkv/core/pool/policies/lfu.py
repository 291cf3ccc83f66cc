"""``"lfu"``: LFU with dynamic aging (LFU-DA), fewest hits first, so old popular pages eventually yield."""

from __future__ import annotations

from array import array
from typing import Any

from pagedkv.core.pool.policies.base import EvictionPolicy

__all__ = ["LfuPolicy"]


class LfuPolicy(EvictionPolicy):
    """LFU-DA over the keyed order: a page ranks ``(aging + hits, tick)``, `hits` counting its hits and merges
    since it was cached; evicting a page raises `aging` to its rank, so a newcomer starts level with the
    popularity of the last page evicted."""

    name = "lfu"
    keyed = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.hits = array("i", [0]) * num_blocks  # hits + merges since the page was cached
        self.aging = 0

    def order_key(self, page: int, tick: int, reused: int) -> tuple[Any, ...]:
        return (self.aging + self.hits[page], tick)

    def hit(self, page: int) -> None:
        self.hits[page] += 1

    def cached(self, page: int) -> None:
        self.hits[page] = 0

    def forgotten(self, page: int) -> None:
        self.hits[page] = 0

    def chosen(self, page: int, key: tuple[Any, ...]) -> None:
        self.aging = key[0]
