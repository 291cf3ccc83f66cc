"""The invariants of `BlockPool`, checked page by page (O(pages); for tests and runtime checks)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from pagedkv.core.errors import require as _require
from pagedkv.core.evictor import check_order
from pagedkv.core.free_lists import NONE, PROTECTED

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.block_pool import BlockPool

__all__ = ["check_pool"]


def _walk(pool: BlockPool, which: int) -> Iterator[int]:
    lists = pool._lists
    prv, nxt, sentinel = lists.prev, lists.next, lists.sentinel[which]
    page, steps = nxt[sentinel], 0
    while page != sentinel:
        _require(prv[nxt[page]] == page, f"free list {which}: link broken after page {page}")
        _require(lists.where[page] == which, f"page {page} is in free list {which} but marked {lists.where[page]}")
        steps += 1
        _require(steps <= pool.num_blocks, f"free list {which} has a cycle")
        yield page
        page = nxt[page]


def check_pool(pool: BlockPool, holders: Mapping[int, int], pins: Mapping[int, int]) -> None:
    """Raise `IntegrityError` unless each page is in use (ref = table references), cached and free
    (in a free list, with a hash; protected iff pinned), or fresh (on the stack, no hash), and its
    pins are the live pins of `pins`."""
    n, ref, hashes = pool.num_blocks, pool._ref, pool._hash
    fresh = list(pool._fresh)
    lists = [list(_walk(pool, 1)), list(_walk(pool, 2)), list(_walk(pool, 3))]
    fresh_set, cached_set = set(fresh), {p for pages in lists for p in pages}
    _require(len(fresh_set) == len(fresh), f"fresh stack has duplicates: {sorted(fresh)}")
    _require(not fresh_set & cached_set, f"pages both fresh and cached-free: {sorted(fresh_set & cached_set)}")
    for which, pages in enumerate(lists, start=1):
        count = pool._lists.count[which]
        _require(len(pages) == count, f"free list {which} holds {len(pages)}, count {count}")
    _require(all(0 <= p < n for p in holders), f"request tables name pages outside [0, {n})")
    for page in range(n):
        held = holders.get(page, 0)
        _require(ref[page] == held, f"page {page}: ref {ref[page]} but {held} table references")
        is_free = page in fresh_set or page in cached_set
        _require(is_free == (held == 0), f"page {page}: ref {held} yet free={is_free}")
        if page in fresh_set:
            _require(hashes[page] is None, f"fresh page {page} still has a hash")
        n_pins = pins.get(page, 0)
        _require(pool._pins[page] == n_pins, f"page {page}: {pool._pins[page]} pins but requests hold {n_pins}")
        _require(not n_pins or hashes[page] is not None, f"page {page} is pinned but not cached")
        where = pool._lists.where[page]
        if page in cached_set:
            _require(hashes[page] is not None, f"cached-free page {page} has no hash")
            _require(where != PROTECTED or n_pins > 0, f"free page {page} is protected without a pin")
        else:
            _require(where == NONE, f"page {page} is marked in free list {where} it is not in")
    for g, cache in enumerate(pool._caches):
        for key, page in cache.items():
            _require(hashes[page] == key, f"prefix cache maps a hash to page {page}, which holds another")
            _require(pool._group[page] == g, f"page {page} is cached in group {g} but marked {pool._group[page]}")
    _require(pool.num_protected <= pool.max_protected,
             f"{pool.num_protected} protected pages, over the cap of {pool.max_protected}")  # fmt: skip
    n_hashed = sum(h is not None for h in hashes)
    _require(n_hashed == pool.num_cached, f"{n_hashed} hashed pages but {pool.num_cached} cache entries")
    _require(pool.enable_prefix_caching or not pool.num_cached, "prefix cache used while disabled")
    if pool._order is not None:
        errors = check_order(pool._order, hashes)
        _require(not errors, "; ".join(errors))
