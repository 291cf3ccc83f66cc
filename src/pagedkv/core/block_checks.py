"""The invariants of a `BlockManager`: request tables, pool and prefix cache agree (O(pages))."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import check_seed
from pagedkv.validation import INT32_MAX, check_int

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.block_manager import BlockManager

__all__ = ["check_block_manager", "check_manager_args"]


def check_manager_args(page_size: object, caching: object, speculative: object, seed: object, *flags: object) -> None:
    """TypeError / ValueError unless a `BlockManager`'s arguments are valid (before anything is built)."""
    check_int("page_size", page_size, 1, INT32_MAX)
    check_int("num_speculative_tokens", speculative, 0, INT32_MAX)
    for name, flag in zip(("enable_prefix_caching", "evict_leaves_first", "partial_page_reuse", "commit_on_alloc"),
                          (caching, *flags), strict=False):  # fmt: skip
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be a bool")
    check_seed("hash_seed", seed)


def check_block_manager(bm: BlockManager) -> None:
    """Raise `IntegrityError` unless every request's committed pages hold its hashes, its other pages
    are private and unhashed, and the pool's states and reference counts match the tables."""
    pool, null = bm.pool, bm.pool.null_block
    holders: Counter[int] = Counter()
    for rid, st in bm._reqs.items():
        pages = st.pages[: st.num_pages].tolist()
        holders.update(pages)
        _require(null not in pages, f"request {rid!r} holds the null page")
        _require(not (st.dummy and pages), f"dummy request {rid!r} holds pages")
        _require(
            st.committed <= min(st.num_pages, len(st.hashes)),
            f"request {rid!r}: committed={st.committed} exceeds its pages or hashes",
        )
        _require(-1 <= st.unwritten <= st.committed, f"request {rid!r}: unwritten={st.unwritten} out of range")
        for i, page in enumerate(pages):
            if i < st.committed:
                _require(pool.block_hash(page) == st.hashes[i], f"request {rid!r} page {i} ({page}) hash mismatch")
            else:
                _require(pool.block_hash(page) is None, f"request {rid!r} uncommitted page {page} has a hash")
                _require(pool.ref_count(page) == 1, f"request {rid!r} private page {page} is shared")
    if bm._partial is not None:
        bm._partial.check(bm._reqs, holders)  # + the pending copies' source references
    pool.check_integrity(holders)
