"""Eviction beyond LRU in the pool: LFU with aging, leaves first, retention priorities with expiry, ARC."""

from __future__ import annotations

import pytest

from pagedkv.core.context import Retention
from pagedkv.core.pool import BlockPool
from pagedkv.core.pool.policies import ArcPolicy, LfuPolicy


def cached_pool(n: int, chain: bool = False, **kwargs: object) -> BlockPool:
    """A pool whose pages 0..n-1 are all in use and cached (a chain 0 <- 1 <- ... when `chain`)."""
    pool = BlockPool(n, **kwargs)  # type: ignore[arg-type]
    pages = pool.allocate(n)
    assert pages == list(range(n))
    for p in pages:
        pool.commit(p, f"h{p}".encode(), 0, p - 1 if chain else -1)
    return pool


def drain(pool: BlockPool) -> list[int]:
    """The order the pool evicts its free pages, one allocation at a time (then every page is held once)."""
    order = []
    while pool.num_free:
        order.extend(pool.allocate(1))
    pool.check_integrity(dict.fromkeys(range(pool.num_blocks), 1))
    return order


def hit_twice(pool: BlockPool, page: int) -> None:
    for _ in range(2):
        pool.touch([page])
        pool.free([page])


@pytest.mark.parametrize(("policy", "expected"), [("lru", [0, 1, 2]), ("lfu", [1, 2, 0])])
def test_lfu_keeps_the_page_hit_most_where_lru_drops_the_oldest(policy: str, expected: list[int]) -> None:
    pool = cached_pool(3, eviction_policy=policy)
    pool.free([0])
    hit_twice(pool, 0)  # page 0: freed first, hit twice since
    pool.free([1, 2])
    assert drain(pool) == expected


def test_lfu_ages_so_old_popular_pages_yield_to_new_ones() -> None:
    pool = cached_pool(4, eviction_policy="lfu")
    pool.free([0, 1])
    hit_twice(pool, 0)
    hit_twice(pool, 1)  # both ranked 0 (aging) + 2 hits; 0 was refreshed before 1
    assert pool.allocate(1) == [0]  # evicting a page ranked 2 raises the aging floor to 2
    assert isinstance(pool.policy, LfuPolicy) and pool.policy.aging == 2
    pool.free([2])  # a cold newcomer now ranks 2 + 0: level with page 1's old popularity
    assert pool.allocate(1) == [1]  # ... and page 1, older, yields first
    pool.free([3])
    hit_twice(pool, 3)  # 2 + 2 hits = 4
    assert drain(pool) == [2, 3]


@pytest.mark.parametrize(("leaves", "expected"), [(False, [3, 1, 0, 2]), (True, [3, 2, 1, 0])])
def test_leaves_first_never_cuts_a_chain_in_the_middle(leaves: bool, expected: list[int]) -> None:
    pool = BlockPool(4, leaves_first=leaves)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for p in (0, 1, 2):  # the chain 0 <- 1 <- 2; page 3 holds nothing reusable
        pool.commit(p, f"h{p}".encode(), 0, p - 1)
    pool.free([3, 1, 0, 2])  # LRU order 1, 0, 2: plain LRU drops the middle page while its child stays
    assert drain(pool) == expected  # the fresh page first, then (leaves first) 2, 1, 0


def test_leaves_first_falls_back_when_only_chain_interiors_are_free() -> None:
    pool = cached_pool(2, chain=True, leaves_first=True)  # 0 <- 1
    pool.free([0])  # the parent is free but its child is still held
    assert pool.allocate(1) == [0]  # no leaf is free: allocation still succeeds
    pool.check_integrity({0: 1, 1: 1})


def test_retention_priority_orders_eviction_and_expires() -> None:
    now = [0.0]
    pool = cached_pool(4)
    pool.set_priority([0], 80)  # for as long as cached
    pool.keyed_order().clock = lambda: now[0]
    pool.set_priority([1], 90, duration_s=5.0)
    pool.set_priority([2], 10)
    pool.free([0, 1, 2, 3])
    assert pool.allocate(1) == [2]  # priority 10 first
    now[0] = 6.0  # page 1's retention has ended: back to 35, ahead of page 0 (80)
    assert drain(pool) == [1, 3, 0]


def test_priority_combines_with_leaves_first() -> None:
    pool = BlockPool(2, leaves_first=True)
    pool.allocate(2)
    pool.commit(0, b"root", 0, -1)
    pool.commit(1, b"child", 0, 0)
    pool.set_priority([1], 90)  # the child outranks its parent
    pool.free([1, 0])
    assert drain(pool) == [1, 0]  # the low-priority parent still waits for its child


@pytest.mark.parametrize(
    ("pages", "priority", "error", "match"),
    [
        ([0], 101, ValueError, r"priority=101 must be at most 100"),
        ([0], -1, ValueError, r"priority=-1 must be at least 0"),
        ([0], 1.5, TypeError, r"priority=1.5 must be an int"),
        ([0, 3], 50, ValueError, r"page 3 is not cached"),
    ],
)
def test_set_priority_rejects_bad_input_and_changes_nothing(pages: list, priority: object, error: type,
                                                            match: str) -> None:  # fmt: skip
    pool = BlockPool(4)
    pool.allocate(4)
    pool.commit(0, b"a")
    pool.free([0, 3])
    before = pool.free_order()
    with pytest.raises(error, match=match):
        pool.set_priority(pages, priority)  # type: ignore[arg-type]
    assert pool._order is None and pool.free_order() == before


def test_retention_validates() -> None:
    with pytest.raises(ValueError, match=r"priority=101 must be an int in \[0, 100\]"):
        Retention(101)
    with pytest.raises(ValueError, match=r"duration_s=0 must be a finite number of seconds > 0"):
        Retention(50, 0)


def test_arc_adapts_its_split_from_ghost_hits() -> None:
    arc = ArcPolicy(num_blocks=3)
    assert arc.from_probation(2, 5)  # p = 0: probation (T1) goes first, as in SLRU
    arc.evicted(b"t1-a", from_probation=True)
    arc.evicted(b"t1-b", from_probation=True)
    arc.evicted(b"t2-a", from_probation=False)
    arc.missed([b"t1-a"])  # T1 was too small: p += max(1, |B2| / |B1|) = max(1, 1 / 2)
    assert arc.p == 1.0 and b"t1-a" not in arc.b1
    assert not arc.from_probation(1, 5) and arc.from_probation(2, 5) and arc.from_probation(1, 0)
    arc.missed([b"t2-a"])  # T2 was too small: p -= max(1, |B1| / |B2|) = 1
    assert arc.p == 0.0 and not arc.b2
    arc.missed([b"never"])  # no ghost: nothing changes
    assert arc.p == 0.0
    for k in range(5):  # ghosts are bounded by the pool size, oldest dropped
        arc.evicted(bytes([k]), from_probation=True)
    assert list(arc.b1) == [bytes([2]), bytes([3]), bytes([4])]


def test_arc_pool_evicts_lru_pages_while_probation_is_within_its_target() -> None:
    pool = cached_pool(4, eviction_policy="arc")
    pool.free([0, 1, 2])  # probation: never reused
    hit_twice(pool, 2)  # page 2 served hits: LRU (T2)
    pool.free([3])
    arc = pool.policy
    assert isinstance(arc, ArcPolicy)
    arc.p = 2.0  # T1 may hold two pages: it holds 3, so the next victim is T1's oldest
    assert pool.allocate(1) == [0]
    assert list(arc.b1) == [b"h0"]
    assert pool.allocate(1) == [2]  # T1 now holds 2 = p: T2's oldest goes
    assert list(arc.b2) == [b"h2"]
