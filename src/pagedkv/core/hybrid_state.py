"""Per-request state of `KVCacheCoordinator` and its invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.tables import RequestPages

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.coordinator import KVCacheCoordinator

__all__ = ["HybridRequest", "Plan", "check_request", "prefix_misses", "release_order"]

_FAR = 1 << 62


@dataclass(slots=True, eq=False)
class HybridRequest:
    """One request's tables (one per group) and its progress through the prefix cache."""

    tables: list[RequestPages]
    dropped: list[int]  # per group: entries [kept, dropped) are null (returned to the pool) unless shared
    committed: int = 0  # leading logical pages committed in every cacheable group
    shared: int = 0  # leading pages this request shares with the cache (hit or merged): never dropped
    protected: list[int] = field(default_factory=list)  # pages it dropped into the protected list
    hashes: list[BlockHash] = field(default_factory=list)
    digest: bytes = b""
    dummy: bool = False
    ready: int = 0  # token slots every decoder group holds pages for (decode fast path)
    next_drop: int = _FAR  # processed position at which some group drops its next page

    @property
    def num_pages(self) -> int:
        """Logical pages of the longest decoder table."""
        return max((t.num_pages for t in self.tables), default=0)


@dataclass(frozen=True, eq=False)
class Plan:
    """What one `alloc` will do, computed before anything changes."""

    hit: int  # logical pages after the prefix hit
    hit_pages: list[list[int]]  # per group: entries to append for the hit (null where not needed)
    new_keys: list[BlockHash]
    digest: bytes
    drops: list[tuple[int, int]]  # per group: entry range to null out
    new: list[int]  # per group: pages to allocate


def check_request(coordinator: KVCacheCoordinator, rid: object, st: HybridRequest) -> None:
    """Raise `IntegrityError` unless each group's table of `st` is consistent with the pool."""
    pool, null = coordinator.pool, coordinator.pool.null_block
    for g, (gm, table) in enumerate(zip(coordinator.groups, st.tables, strict=True)):
        pages = table.pages[: table.num_pages].tolist()
        _require(not (st.dummy and pages), f"dummy request {rid!r} holds pages")
        for i, page in enumerate(pages):
            if page == null:
                _require(gm.lazy and gm.kept_pages() <= i < st.dropped[g], f"{rid!r} group {g} entry {i} is null")
                continue
            _require(
                not (gm.lazy and max(gm.kept_pages(), st.shared) <= i < st.dropped[g]),
                f"{rid!r} group {g} kept dropped entry {i}",
            )
            if i < st.committed and gm.cacheable:
                _require(pool.block_hash(page) == st.hashes[i] and pool._group[page] == g,
                         f"{rid!r} group {g} page {i} ({page}) is not cached under its hash")  # fmt: skip
            else:
                _require(pool.block_hash(page) is None and pool.ref_count(page) == 1,
                         f"{rid!r} group {g} private page {page} is shared or hashed")  # fmt: skip


def prefix_misses(pages: list[int | None]) -> list[int]:
    """misses[k] = how many of pages[:k] are None."""
    out = [0]
    for p in pages:
        out.append(out[-1] + (p is None))
    return out


def release_order(coordinator: KVCacheCoordinator, st: HybridRequest) -> tuple[list[int], list[bool]]:
    """Every group's pages, deepest position first, groups interleaved; dropped window pages
    still cached come along unheld, so they get the same recency as the rest of the prefix.

    LRU then evicts a prefix position in every group at about the same time: a window
    group never loses the pages a hit needs while the full group's pages of that prefix
    (useless without them) stay cached, which is how vLLM's hit rate collapses.
    """
    null, cached = coordinator.pool.null_block, coordinator.pool.cached_page
    tables = [t.pages[: t.num_pages].tolist() for t in st.tables]
    pages: list[int] = []
    held: list[bool] = []
    for i in range(max((len(t) for t in tables), default=0) - 1, -1, -1):
        for g, table in enumerate(tables):
            if i < len(table) and table[i] != null:
                pages.append(table[i])
                held.append(True)
            elif i < min(st.committed, len(st.hashes)) and coordinator.groups[g].cacheable:
                page = cached(st.hashes[i], g)
                if page is not None:
                    pages.append(page)
                    held.append(False)
    return pages, held
