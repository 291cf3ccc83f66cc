"""Per-request state of `KVCacheCoordinator` and its invariants."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.tables import RequestPages

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.coordinator import KVCacheCoordinator

__all__ = ["HybridRequest", "Plan", "check_request", "prefix_misses"]

_FAR = 1 << 62


@dataclass(slots=True, eq=False)
class HybridRequest:
    """One request's tables (one per group) and its progress through the prefix cache."""

    tables: list[RequestPages]
    dropped: list[int]  # per group: entries [kept, dropped) are null (returned to the pool)
    committed: int = 0  # leading logical pages committed in every cacheable group
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
                not (gm.lazy and gm.kept_pages() <= i < st.dropped[g]), f"{rid!r} group {g} kept dropped entry {i}"
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
