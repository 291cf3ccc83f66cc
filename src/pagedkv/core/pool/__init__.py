"""The page pool of one replica: reference counts, the prefix cache and the eviction order.

`BlockPool` (block_pool.py) holds the pages; eviction.py the free lists and the keyed order every policy
shares; wanted.py queue-aware retention; policies/ one file per eviction policy, behind `EvictionPolicy`,
and the registry of their names (`EVICTION_POLICIES`, `register_eviction_policy`).

Every page id in ``[0, num_blocks)`` is in exactly one state::

    in use     ref > 0                    held by one or more requests
    cached     ref == 0, hash set         evictable, in a free list, still hittable
    fresh      ref == 0, no hash          on the fresh stack, holds nothing reusable

Page ``num_blocks`` is the null page: never handed out, never counted.

Allocation takes fresh pages first (most recently freed first, so a fresh
pool hands out 0, 1, 2, ...), then evicts cached pages. A cached page is
never evicted while a fresh one exists. Cached free pages sit in one of
three lists, each oldest first; the eviction policy (`policies`: LRU by
default) takes victims from the first two (plain list order: probation,
then LRU), the protected ones go last:

    probation  (segmented policies) cached pages never reused since they were cached
    LRU        the others
    protected  pinned pages: a running request still needs them kept

Callers free a request's pages tail first, so the deepest pages of a prefix
are evicted before its head.

A *pin* marks a cached page that a running request no longer reads (it fell
out of the request's attention window) but whose loss would break that
request's prefix for later hits: the full-attention pages of the prefix stay
held, so the window pages must stay too. A free pinned page is protected:
evicted only after every unpinned one. Pins are counted; `unpin` at request
end returns the page to the LRU. Each caching of a page gets a new stamp, so
an owner's pin on a page evicted and re-cached since is recognised as stale.

Storage is struct-of-arrays (about 47 bytes per page before any caching): int32
ref counts and pins, int64 stamps, int32 free-list links and fresh stack, a hash
slot, one byte each for the group that cached it, its list and its reuse bit, and
queue-aware retention's int64 set-aside sequence. A pool of a million pages builds
in milliseconds.

Hybrid models (several KV cache groups, e.g. sliding-window and full layers)
share one pool: a page id belongs to one group at a time, and each group has
its own prefix cache (the same prefix hash maps to a different page in each).
"""

from pagedkv.core.pool.block_pool import BlockPool
from pagedkv.core.pool.policies import (
    EVICTION_POLICIES,
    EvictionPolicy,
    register_eviction_policy,
    unregister_eviction_policy,
)

__all__ = ["EVICTION_POLICIES", "BlockPool", "EvictionPolicy", "register_eviction_policy", "unregister_eviction_policy"]
