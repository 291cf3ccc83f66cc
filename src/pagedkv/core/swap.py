"""Swap preemption, the bookkeeping half (pure Python): a request's table taken apart and rebuilt.

    pages, record = swap.snapshot(bm, rid)   # before: the caller copies `pages` out
    bm.release(rid)                          # device pages free (committed ones stay hittable)
    ...
    todo = swap.restore(bm, ctx, record)     # same table shape; device-cached prefix pages reused
    (the caller copies the swapped KV into the `todo` pages)
    swap.recommit(bm, ctx, record)           # committed pages back in the prefix cache

The context is never reset: its tokens, processed length and cached prefix
stay as they were, so the request resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import RequestID, TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.hashing import BlockHash

__all__ = ["SwappedPages", "recommit", "restore", "snapshot"]


@dataclass(frozen=True)
class SwappedPages:
    """A released request's table, enough to rebuild it page for page."""

    num_pages: int
    committed: int  # leading pages that were in the prefix cache
    hashes: tuple[BlockHash, ...]
    digest: bytes


def snapshot(bm: BlockManager, request_id: RequestID) -> tuple[list[int], SwappedPages]:
    """The request's pages in logical order and its `SwappedPages`. No side effects."""
    st = bm._claimed(request_id)
    record = SwappedPages(st.num_pages, st.committed, tuple(st.hashes), st.digest)
    return st.pages[: st.num_pages].tolist(), record


def restore(bm: BlockManager, ctx: TextContext, record: SwappedPages) -> list[tuple[int, int]]:
    """Claim ``ctx.request_id`` again with a table of ``record.num_pages`` pages: the leading
    committed pages the device prefix cache still holds, then fresh pages.

    Returns ``(logical index, page)`` for every fresh page: the caller must
    copy the swapped KV of that index into it before the next forward.
    Raises `InsufficientBlocksError` / `ValueError` and changes nothing when
    the pool lacks pages or the request is claimed.
    """
    if bm.contains(ctx.request_id):
        raise ValueError(f"request {ctx.request_id!r} is claimed; only a released (swapped-out) request is restored")
    pool = bm.pool
    hits = pool.lookup(list(record.hashes), 0, record.committed) if bm.enable_prefix_caching else []
    need = record.num_pages - len(hits)
    available = pool.num_free - pool.count_unreferenced(hits)
    if need > available:
        raise InsufficientBlocksError(
            f"Cannot get {need} free blocks to swap request {ctx.request_id!r} back in (only {available} "
            f"available; {pool.num_used}/{pool.num_blocks} blocks currently in use)",
            needed=need,
            available=available,
        )
    bm.claim(ctx.request_id)
    st = bm._reqs[ctx.request_id]
    pool.touch(hits)
    fresh = pool.allocate(need)
    st.append(hits)
    st.append(fresh)
    st.hashes = list(record.hashes)
    st.digest = record.digest
    st.committed = len(hits)
    return [(len(hits) + i, page) for i, page in enumerate(fresh)]


def recommit(bm: BlockManager, ctx: TextContext, record: SwappedPages) -> None:
    """Commit the restored pages that were committed before the swap (after their KV is back)."""
    st = bm._claimed(ctx.request_id)
    if record.committed > st.committed:
        bm._commit(st, ctx, record.committed)
