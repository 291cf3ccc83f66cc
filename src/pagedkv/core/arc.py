"""`ArcState`: the adaptive split of ARC (Megiddo & Modha) over the pool's two cached-page lists.

With ``eviction_policy="arc"`` the pool keeps SLRU's lists: probation (T1,
cached pages never reused since they were cached) and LRU (T2, pages that
served a hit). Plain SLRU always evicts T1 first; ARC evicts from T1 only
while it holds more than a target `p` pages, and adapts `p` from ghosts,
the hashes of recently evicted pages:

- a request misses a hash recently evicted from T1 (ghost B1): T1 was too
  small, so `p` grows by max(1, |B2| / |B1|);
- it misses one recently evicted from T2 (ghost B2): `p` shrinks by
  max(1, |B1| / |B2|).

Each ghost list keeps at most `num_blocks` hashes (oldest dropped). Every
page a lookup wanted past its last hit counts as a miss.
"""

from __future__ import annotations

from pagedkv.core.hashing import BlockHash

__all__ = ["ArcState"]


class ArcState:
    """Target size `p` of T1 and the two ghost lists (insertion-ordered dicts used as bounded FIFOs)."""

    def __init__(self, num_blocks: int) -> None:
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

    def missed(self, block_hash: BlockHash) -> None:
        """A lookup wanted `block_hash` and did not find it cached: adapt on a ghost hit."""
        b1, b2 = self.b1, self.b2
        if block_hash in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[block_hash]
        elif block_hash in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[block_hash]
