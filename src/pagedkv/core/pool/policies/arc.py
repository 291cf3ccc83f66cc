"""``"arc"``: ARC (Megiddo & Modha) over SLRU's two lists, its split adapted from ghosts of evicted pages.

Probation is T1 (cached pages never reused since they were cached), LRU is T2 (pages that served a hit).
Plain SLRU always evicts T1 first; ARC evicts from T1 only while it holds more than a target `p` pages, and
adapts `p` from ghosts, the hashes of recently evicted pages: a miss on a hash recently evicted from T1
(ghost B1) grows `p` by max(1, |B2| / |B1|); a miss on one evicted from T2 (ghost B2) shrinks it by
max(1, |B1| / |B2|). Each ghost list keeps at most `num_blocks` hashes (oldest dropped). Under a keyed
order (retention priorities, leaves first) ARC ranks pages as SLRU does, with no adaptive split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool.policies.base import EvictionPolicy

__all__ = ["ArcPolicy"]


class ArcPolicy(EvictionPolicy):
    """Target size `p` of T1 and the two ghost lists (insertion-ordered dicts used as bounded FIFOs)."""

    name = "arc"
    segmented = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.capacity = num_blocks
        self.p = 0.0
        self.b1: dict[BlockHash, None] = {}
        self.b2: dict[BlockHash, None] = {}

    def from_probation(self, n_probation: int, n_lru: int) -> bool:
        """True when the next victim comes from T1 (probation)."""
        return n_probation > 0 and (n_probation > self.p or n_lru == 0)

    def evicted(self, block_hash: BlockHash, from_probation: bool) -> None:
        """Remember an evicted page's hash in the ghost list of the list it left."""
        ghosts = self.b1 if from_probation else self.b2
        ghosts[block_hash] = None
        if len(ghosts) > self.capacity:
            del ghosts[next(iter(ghosts))]

    def missed(self, keys: Sequence[BlockHash]) -> None:
        """Lookups wanted `keys` and did not find them cached: adapt on each ghost hit, in order."""
        b1, b2 = self.b1, self.b2
        for block_hash in keys:
            if block_hash in b1:
                self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                del b1[block_hash]
            elif block_hash in b2:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                del b2[block_hash]

    def order_key(self, page: int, tick: int, reused: int) -> tuple[Any, ...]:
        return (reused, tick)
