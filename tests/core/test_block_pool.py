"""BlockPool: exact page ids, free order, LRU eviction, commit merging, integrity checks."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InsufficientBlocksError, IntegrityError
from pagedkv.core.pool import BlockPool


def check(pool: BlockPool, holders: dict[int, int]) -> None:
    pool.check_integrity(holders)


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(6)
    assert pool.null_block == 6 and pool.num_free == 6 and pool.num_used == 0
    assert pool.allocate(2) == [0, 1] and pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(p) for p in range(6)] == [1, 1, 1, 1, 1, 0]
    check(pool, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1})


def test_unhashed_pages_are_reused_first_lifo() -> None:
    pool = BlockPool(4)
    pages = pool.allocate(4)
    pool.free(reversed(pages))  # tail first: 3, 2, 1, 0 pushed; 0 comes back first
    assert pool.free_order() == [0, 1, 2, 3]
    check(pool, {})


def test_cached_pages_are_evicted_lru_after_fresh_ones() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)  # 0 1 2
    for i, page in enumerate(a):
        assert pool.commit(page, f"h{i}".encode()) == page
    pool.free(reversed(a))  # LRU order: 2, 1, 0
    assert pool.free_order() == [3, 4, 2, 1, 0]
    assert pool.lookup([b"h0", b"h1", b"h2", b"zz"], 0, 4) == [0, 1, 2]
    got = pool.allocate(3)  # fresh 3, 4, then evict 2
    assert got == [3, 4, 2] and pool.num_evictions == 1
    assert pool.block_hash(2) is None and pool.lookup([b"h0", b"h1", b"h2"], 0, 3) == [0, 1]
    check(pool, {3: 1, 4: 1, 2: 1})


def test_allocate_more_than_free_takes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(InsufficientBlocksError, match=r"Cannot get 2 free blocks \(only 1 available\)"):
        pool.allocate(2)
    assert pool.free_order() == [2]
    check(pool, {0: 1, 1: 1})


def test_touch_takes_cached_page_out_of_free_list() -> None:
    pool = BlockPool(3)
    [p] = pool.allocate(1)
    pool.commit(p, b"x")
    pool.free([p])
    assert pool.count_unreferenced([p]) == 1 and pool.num_free == 3
    pool.touch([p])
    assert pool.ref_count(p) == 1 and pool.num_free == 2 and pool.free_order() == [1, 2]
    pool.touch([p])
    assert pool.ref_count(p) == 2
    check(pool, {p: 2})


def test_hold_adds_a_reference_without_counting_a_hit() -> None:
    pool = BlockPool(3, eviction_policy="slru")
    [p] = pool.allocate(1)
    pool.commit(p, b"x")
    with pytest.raises(ValueError, match="page 1 is not held"):
        pool.hold([p, 1])
    assert pool.ref_count(p) == 1  # (a refused call changes nothing)
    pool.hold([p])
    assert pool.ref_count(p) == 2 and not pool.is_reused(p)  # (touch would mark it reused: SLRU's frequent list)
    pool.free([p, p])
    assert pool.ref_count(p) == 0 and next(pool.list_pages(3)) == p  # still on probation
    check(pool, {})


def test_can_allocate_unwanted_counts_fresh_then_unwanted_cached_pages() -> None:
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.commit(a, b"a")
    pool.commit(b, b"b")
    pool.free([a, b])  # 3 fresh pages, a and b cached and free
    pool.want([b"b"], 1.0)  # a waiting request will hit b
    assert [pool.can_allocate_unwanted(n) for n in (3, 4, 5, 6)] == [True, True, False, False]
    pool.want([b"b"], 1.0, -1)
    assert pool.can_allocate_unwanted(5) and not pool.can_allocate_unwanted(6)
    check(pool, {})


def test_commit_merges_duplicate() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.commit(a, b"same") == a
    assert pool.commit(b, b"same") == a  # b is freed, a gains the reference
    assert pool.ref_count(a) == 2 and pool.ref_count(b) == 0 and pool.block_hash(b) is None
    assert pool.free_order() == [b, 2, 3]
    check(pool, {a: 2})


def test_reset_prefix_cache_keeps_in_use_hashes() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.commit(a, b"a")
    pool.commit(b, b"b")
    pool.free([b])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup([b"a"], 0, 1) == [a] and pool.lookup([b"b"], 0, 1) == []
    assert pool.block_hash(b) is None and pool.num_cached == 1
    check(pool, {a: 1})


def test_null_page_is_ignored_by_free() -> None:
    pool = BlockPool(2)
    pool.free([pool.null_block])
    assert pool.num_free == 2
    check(pool, {})


def test_integrity_catches_corruption() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(IntegrityError, match="page 0: ref 1 but 0 table references"):
        check(pool, {})
    pool._ref[0] = 0
    with pytest.raises(IntegrityError, match="page 0: ref 0 yet free=False"):
        check(pool, {})
    pool = BlockPool(4)
    pool._fresh.append(1)
    with pytest.raises(IntegrityError, match="fresh stack has duplicates"):
        check(pool, {})
    pool = BlockPool(4)
    [p] = pool.allocate(1)
    pool.commit(p, b"k")
    pool._caches[0][b"other"] = p
    with pytest.raises(IntegrityError, match="maps a hash to page 0, which holds another"):
        check(pool, {p: 1})


def test_million_page_pool() -> None:
    pool = BlockPool(1_000_000)
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free == 999_997
    with pytest.raises(ValueError, match="num_blocks=0 must be at least 1"):
        BlockPool(0)


def test_uncache_drops_hashes_with_events_but_counts_no_eviction() -> None:
    pool = BlockPool(5)
    removed: list[tuple[bytes, int]] = []
    pool.on_removed = lambda key, group: removed.append((key, group))
    pages = pool.allocate(3)  # 0 1 2, all cached
    for i, page in enumerate(pages):
        pool.commit(page, f"h{i}".encode())
    pool.free([2])  # page 2: free and cached (LRU); pages 0 and 1 stay held
    assert pool.uncache([1, 2, 4]) == 2  # page 4 holds no hash: skipped
    assert removed == [(b"h1", 0), (b"h2", 0)]
    assert pool.block_hash(1) is None and pool.ref_count(1) == 1  # held, unhashed: no later hit
    assert pool.lookup([b"h0", b"h1"], 0, 2) == [0]
    assert pool.free_order() == [2, 3, 4] and pool.num_evictions == 0  # page 2 is fresh again, first out
    check(pool, {0: 1, 1: 1})
