"""BlockPool eviction order: SLRU segments, pins and the protected list, stamps, the cap."""

from __future__ import annotations

import pytest

from pagedkv.core.errors import InsufficientBlocksError, IntegrityError
from pagedkv.core.pool import BlockPool
from pagedkv.params import KVCacheParams


def cached_pool(n: int, cached: int, **kwargs: object) -> tuple[BlockPool, list[int]]:
    """A pool of `n` pages whose first `cached` are committed under b"h0", b"h1", ... and in use."""
    pool = BlockPool(n, **kwargs)  # type: ignore[arg-type]
    pages = pool.allocate(cached)
    for i, page in enumerate(pages):
        assert pool.commit(page, f"h{i}".encode()) == page
    return pool, pages


def test_slru_evicts_never_reused_pages_before_reused_ones() -> None:
    pool, pages = cached_pool(4, 4, eviction_policy="slru")
    pool.touch([1])  # page 1 served a hit: ref 2
    pool.free([3, 2, 1, 0])
    pool.free([1])
    assert pool.free_order() == [3, 2, 0, 1]  # probation (never reused) first, then the LRU
    assert pool.allocate(3) == [3, 2, 0] and pool.lookup([b"h0", b"h1"], 1, 2) == [1]
    pool.check_integrity({3: 1, 2: 1, 0: 1})


def test_lru_ignores_reuse() -> None:
    pool, pages = cached_pool(4, 4)
    pool.touch([1])
    pool.free([3, 2, 1, 0])
    pool.free([1])
    assert pool.free_order() == [3, 2, 0, 1]  # same order here, by recency alone
    pool.touch([3])
    pool.free([3])
    assert pool.free_order() == [2, 0, 1, 3]  # with SLRU, 3 (now reused) would still follow 2 and 0


def test_pinned_free_page_is_protected_until_unpinned() -> None:
    pool, pages = cached_pool(4, 3)
    pins = pool.pin([0])
    assert pins == [(0, pool.stamp(0))] and pool.pin_count(0) == 1
    pool.free([2, 1, 0])
    assert pool.is_protected(0) and pool.num_protected == 1
    assert pool.free_order() == [3, 2, 1, 0] and pool.num_free == 4
    with pytest.raises(InsufficientBlocksError, match=r"Cannot get 4 free blocks \(only 3 available\)"):
        pool.allocate(4)  # never takes a protected page
    pool.check_integrity({}, {0: 1})
    pool.unpin(pins)
    assert not pool.is_protected(0) and pool.free_order() == [3, 2, 1, 0]
    assert pool.allocate(4) == [3, 2, 1, 0]
    pool.check_integrity({0: 1, 1: 1, 2: 1, 3: 1})


def test_pin_of_a_free_page_moves_it_and_pins_count() -> None:
    pool, pages = cached_pool(4, 2)
    pool.free([1, 0])
    a = pool.pin([1])
    b = pool.pin([1], reused=True)
    assert pool.pin_count(1) == 2 and pool.is_reused(1) and pool.free_order() == [2, 3, 0, 1]
    pool.unpin(a)
    assert pool.is_protected(1)
    pool.unpin(b)
    assert not pool.is_protected(1) and pool.free_order() == [2, 3, 0, 1]
    pool.check_integrity({})
    with pytest.raises(ValueError, match="page 2 is not cached"):
        pool.pin([2])


def test_pins_on_an_evicted_page_are_stale() -> None:
    pool, pages = cached_pool(2, 2)
    old = pool.pin([0])
    pool.free([0])
    assert pool.take([0]) == [0] and pool.pin_count(0) == 0 and pool.block_hash(0) is None
    pool.commit(0, b"again")
    new = pool.pin([0])
    assert new[0][1] != old[0][1]
    pool.unpin(old)  # refers to the earlier caching: ignored
    assert pool.pin_count(0) == 1
    pool.check_integrity({0: 1, 1: 1}, {0: 1})
    with pytest.raises(ValueError, match="page 0 is not free and cached"):
        pool.take([0])


def test_small_pool_rounds_the_cap_down() -> None:
    pool, pages = cached_pool(3, 1)  # 0.25 * 3 pages: no room
    pool.pin(pages)
    pool.free(pages)
    assert pool.max_protected == 0 and pool.num_protected == 0 and pool.allocate(3) == [1, 2, 0]


def test_protected_list_is_capped() -> None:
    pool, pages = cached_pool(8, 4, protected_fraction=0.25)  # at most 2 protected pages
    assert pool.max_protected == 2
    pool.pin(pages)
    pool.free(reversed(pages))
    assert pool.num_protected == 2 and [pool.is_protected(p) for p in pages] == [False, False, True, True]
    assert pool.allocate(6) == [4, 5, 6, 7, 1, 0]  # pinned pages over the cap are evicted like others
    assert pool.pin_count(0) == 0
    pool.check_integrity({p: 1 for p in (4, 5, 6, 7, 1, 0)}, {2: 1, 3: 1})


def test_reset_prefix_cache_keeps_pinned_pages() -> None:
    pool, pages = cached_pool(4, 2)
    pool.pin([0])
    pool.free([1, 0])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup([b"h0"], 0, 1) == [0] and pool.block_hash(1) is None
    pool.check_integrity({}, {0: 1})


def test_integrity_catches_pin_corruption() -> None:
    pool, pages = cached_pool(4, 1)
    pool.pin([0])
    with pytest.raises(IntegrityError, match="page 0: 1 pins but requests hold 0"):
        pool.check_integrity({0: 1})
    pool.free([0])
    pool._pins[0] = 0
    with pytest.raises(IntegrityError, match="free page 0 is protected without a pin"):
        pool.check_integrity({})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"eviction_policy": "fifo"},
            ValueError,
            r"eviction_policy='fifo' must be one of \('lru', 'slru', 'lfu', 'arc'\)",
        ),
        ({"protected_fraction": 1.5}, ValueError, r"protected_fraction=1.5 must be in \[0, 1\]"),
        ({"protected_fraction": "half"}, TypeError, "protected_fraction='half' must be a float"),
    ],
)
def test_eviction_settings_are_validated(kwargs: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        BlockPool(4, **kwargs)  # type: ignore[arg-type]
    from helpers import make_params

    with pytest.raises(error, match=message):
        make_params(**kwargs)
    assert isinstance(make_params(eviction_policy="slru", protected_fraction=0), KVCacheParams)
