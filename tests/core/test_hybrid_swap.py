"""Swap preemption of a hybrid request (`KVCacheCoordinator.swap_snapshot` / `swap_restore` / `swap_recommit`):
the restore reuses the committed prefix pages the device still caches in every cacheable group, keeps window
groups' dropped entries null, returns (index in the snapshot's page list, fresh page) for the rest, and a
refused restore changes nothing."""

from __future__ import annotations

import pytest

from helpers import ctx, snapshot
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import CrossAttentionManager, FullAttentionManager, SlidingWindowManager

N = 30  # pool pages; the null page id is 30


def swapped_out(num_blocks: int = N) -> tuple[KVCacheCoordinator, object, list[int], object, list[list[int]]]:
    """A full + sliding-window coordinator whose request "a" (17 prompt tokens, 3 decoded) is swapped out:
    (coordinator, context, snapshot pages, record, tables before the swap)."""
    c = KVCacheCoordinator(num_blocks, 4, [FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6)],
                           enable_prefix_caching=True)  # fmt: skip
    a = ctx("a", range(17))
    c.claim("a")
    for token in (100, 101, 102):
        c.alloc(a)
        a.update(token)
        c.step(a)
    c.alloc(a)
    tables = [c.get_req_blocks("a", g) for g in range(2)]
    pages, record = c.swap_snapshot("a")
    c.release("a")
    c.check_integrity()
    return c, a, pages, record, tables


def positions(tables: list[list[int]], null: int) -> list[tuple[int, int]]:
    """(group, entry) of every live entry, in snapshot order (group by group, table order)."""
    return [(g, i) for g, table in enumerate(tables) for i, page in enumerate(table) if page != null]


def test_restore_reuses_the_cached_prefix_of_every_group_and_keeps_window_nulls() -> None:
    c, a, pages, record, before = swapped_out()
    null = c.pool.null_block
    assert null in before[1] and before[1][0] == null  # the window dropped its first pages
    assert pages == [p for table in before for p in table if p != null] and record.num_pages == len(pages)
    assert record.committed == 4  # 19 tokens written: pages 0-3 committed in both groups
    todo = c.swap_restore(a, record)
    after = [c.get_req_blocks("a", g) for g in range(2)]
    c.check_integrity()
    assert [[p == null for p in t] for t in after] == [[p == null for p in t] for t in before]  # same shape
    where = positions(before, null)
    for index, page in todo:  # each fresh page is at the entry its snapshot index names
        g, i = where[index]
        assert after[g][i] == page and i >= record.committed
    copied = {index for index, _ in todo}
    for index, (g, i) in enumerate(where):  # every other live entry is the same cached page as before
        assert (index in copied) == (i >= record.committed)
        if index not in copied:
            assert after[g][i] == before[g][i]
    assert todo and len(todo) < len(pages)
    c.swap_recommit(a, record)
    c.check_integrity()
    for token in (103, 104, 105, 106):  # it decodes on from where it stopped
        c.alloc(a)
        a.update(token)
        c.step(a)
        c.check_integrity()
    c.release("a")
    assert c.pool.num_used == 0


def test_a_window_page_gone_stops_the_reuse_in_every_group() -> None:
    c, a, pages, record, before = swapped_out()
    null = c.pool.null_block
    j = next(i for i in range(record.committed) if before[1][i] != null)  # the window's first live committed page
    assert j > 0 and c.pool.uncache([before[1][j]]) == 1  # evicted from the device cache
    todo = c.swap_restore(a, record)
    after = [c.get_req_blocks("a", g) for g in range(2)]
    c.check_integrity()
    assert after[0][:j] == before[0][:j] and after[1][:j] == before[1][:j]  # the prefix below j is reused
    fresh = {page for _, page in todo}
    assert all(after[g][i] in fresh for g in range(2) for i in range(j, len(after[g])) if after[g][i] != null)
    assert len(todo) == len(pages) - j  # (the window's entries below j are null: only the full group reuses)
    c.swap_recommit(a, record)
    c.check_integrity()
    assert [c.pool.block_hash(c.get_req_blocks("a", g)[j]) for g in range(2)] == [record.hashes[j]] * 2


def test_cross_attention_pages_always_come_back_fresh() -> None:
    c = KVCacheCoordinator(N, 4, [FullAttentionManager(0, 4), CrossAttentionManager(1, 4)], enable_prefix_caching=True)
    a = ctx("a", range(9), encoder_length=8)
    c.claim("a")
    c.alloc(a)
    a.update(50)
    c.step(a)
    c.alloc(a)
    before = [c.get_req_blocks("a", g) for g in range(2)]
    pages, record = c.swap_snapshot("a")
    c.release("a")
    todo = c.swap_restore(a, record)
    c.check_integrity()
    after = [c.get_req_blocks("a", g) for g in range(2)]
    assert after[0][:2] == before[0][:2]  # the decoder's committed pages are reused
    assert [i for i, _ in todo] == [2, 3, 4]  # its third page and the encoder's two pages are copied back
    assert after[1] == [page for i, page in todo if i >= 3]


@pytest.mark.parametrize("taken", range(1, 31))
def test_a_refused_restore_changes_nothing(taken: int) -> None:
    """Whatever another request holds, the restore succeeds whole or raises and leaves no trace (the free
    cached pages it would reuse count against the fresh pages it needs)."""
    c, a, pages, record, _ = swapped_out()
    other = ctx("b", range(500, 500 + taken * 2))  # holds `taken` pages, the rest of the pool free or cached
    c.claim("b")
    try:
        c.alloc(other)
    except InsufficientBlocksError:
        pytest.skip("the other request does not fit")
    state = snapshot(c, a)  # type: ignore[arg-type]
    try:
        todo = c.swap_restore(a, record)
    except InsufficientBlocksError as error:
        assert "to swap request 'a' back in" in str(error)
        assert snapshot(c, a) == state and not c.contains("a")  # type: ignore[arg-type]
    else:
        c.swap_recommit(a, record)
        assert len(todo) <= len(pages)
    c.check_integrity()


def test_restore_refuses_a_claimed_request_or_another_group_count() -> None:
    c, a, _, record, _ = swapped_out()
    bm = BlockManager(N, 4, enable_prefix_caching=True)
    bm.claim("x")
    bm.alloc(ctx("x", range(6)))
    _, one_group = bm.swap_snapshot("x")
    state = snapshot(c, a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="record has 1 groups but this bookkeeping has 2"):
        c.swap_restore(a, one_group)
    with pytest.raises(ValueError, match="record has 2 groups but this bookkeeping has 1"):
        bm.swap_restore(ctx("y", range(6)), record)  # type: ignore[arg-type]
    c.claim("a")
    with pytest.raises(ValueError, match="request 'a' is claimed; only a released"):
        c.swap_restore(a, record)
    c.release("a")
    assert snapshot(c, a) == state  # type: ignore[arg-type]
