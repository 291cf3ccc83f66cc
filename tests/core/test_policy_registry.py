"""The eviction policy registry: a policy registered by name drives a real pool; unknown names are refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers import make_params
from pagedkv.core.pool import (
    EVICTION_POLICIES,
    BlockPool,
    EvictionPolicy,
    register_eviction_policy,
    unregister_eviction_policy,
)
from pagedkv.core.pool.policies import LruPolicy


class FifoPolicy(EvictionPolicy):
    """First in, first out: pages leave in the order they were cached, whatever their hits and frees."""

    name = "fifo"
    keyed = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.cached_at = [0] * num_blocks
        self.count = 0

    def cached(self, page: int) -> None:
        self.count += 1
        self.cached_at[page] = self.count

    def order_key(self, page: int, tick: int, reused: int) -> tuple[Any, ...]:
        return (self.cached_at[page],)


class ReusedFirstPolicy(EvictionPolicy):
    """Segmented, but the pages that served a hit go before the never-reused ones (a list policy)."""

    name = "reused-first"
    segmented = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.victims: list[tuple[Any, bool]] = []

    def from_probation(self, n_probation: int, n_lru: int) -> bool:
        return n_lru == 0

    def evicted(self, block_hash: Any, from_probation: bool) -> None:
        self.victims.append((block_hash, from_probation))


@pytest.fixture
def registered() -> Iterator[None]:
    register_eviction_policy(FifoPolicy)
    register_eviction_policy(ReusedFirstPolicy)
    yield
    unregister_eviction_policy("fifo")
    unregister_eviction_policy("reused-first")


def cached_pool(policy: str, order: list[int]) -> BlockPool:
    """A pool of 4 pages, all held, cached in `order`, then freed 0, 1, 2, 3, and page 2 hit (held and freed)
    once more: LRU would now evict 0, 1, 3, 2."""
    pool = BlockPool(4, eviction_policy=policy)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for page in order:
        pool.commit(page, f"h{page}".encode())
    pool.free([0, 1, 2, 3])
    pool.touch([2])
    pool.free([2])
    return pool


def drain(pool: BlockPool) -> list[int]:
    """The order the pool evicts its free pages, one allocation at a time."""
    taken = []
    while pool.num_free:
        taken.extend(pool.allocate(1))
    pool.check_integrity(dict.fromkeys(range(pool.num_blocks), 1))
    return taken


@pytest.mark.usefixtures("registered")
def test_a_registered_policy_orders_a_real_pools_evictions() -> None:
    assert list(EVICTION_POLICIES)[-2:] == ["fifo", "reused-first"]
    assert drain(cached_pool("lru", [2, 0, 3, 1])) == [0, 1, 3, 2]
    pool = cached_pool("fifo", [2, 0, 3, 1])
    assert isinstance(pool.policy, FifoPolicy)
    assert drain(pool) == [2, 0, 3, 1]  # the order they were cached in, page 2's later hit notwithstanding


@pytest.mark.usefixtures("registered")
def test_a_list_policy_overriding_the_split_is_asked_page_by_page() -> None:
    assert ReusedFirstPolicy.page_by_page and not FifoPolicy.page_by_page and not LruPolicy.page_by_page
    assert FifoPolicy.listens == {"cached"} and not ReusedFirstPolicy.listens and not LruPolicy.listens
    pool = cached_pool("reused-first", [0, 1, 2, 3])
    assert drain(pool) == [2, 0, 1, 3]  # page 2 served a hit: it goes first, then probation in LRU order
    assert isinstance(pool.policy, ReusedFirstPolicy)
    assert pool.policy.victims == [(b"h2", False), (b"h0", True), (b"h1", True), (b"h3", True)]


@pytest.mark.usefixtures("registered")
def test_the_params_accept_exactly_the_registered_names() -> None:
    assert make_params(eviction_policy="fifo").eviction_policy == "fifo"
    unregister_eviction_policy("fifo")
    try:
        with pytest.raises(ValueError, match=r"eviction_policy='fifo' must be one of \('lru', 'slru', 'lfu', 'arc', "):
            make_params(eviction_policy="fifo")
    finally:
        register_eviction_policy(FifoPolicy)


def pool_of(eviction_policy: Any) -> BlockPool:
    return BlockPool(4, eviction_policy=eviction_policy)


@pytest.mark.parametrize("make", [pool_of, make_params], ids=["BlockPool", "KVCacheParams"])
@pytest.mark.parametrize("custom", [False, True], ids=["built-ins", "with-custom"])
def test_an_unknown_name_is_refused_naming_the_allowed_ones(make: Any, custom: bool,
                                                            request: pytest.FixtureRequest) -> None:  # fmt: skip
    if custom:
        request.getfixturevalue("registered")
    allowed = tuple(EVICTION_POLICIES)
    assert allowed == ("lru", "slru", "lfu", "arc", *(("fifo", "reused-first") if custom else ()))
    with pytest.raises(ValueError) as refused:
        make(eviction_policy="mru")
    assert str(refused.value) == f"eviction_policy='mru' must be one of {allowed}"
    with pytest.raises(ValueError, match=r"eviction_policy=\['lru'\] must be one of"):
        make(eviction_policy=["lru"])  # (unhashable: refused as well, not a TypeError from the registry)


def test_registration_refuses_bad_policies_and_changes_nothing() -> None:
    before = dict(EVICTION_POLICIES)

    class Nameless(EvictionPolicy):
        pass

    class Impostor(EvictionPolicy):
        name = "lru"

    with pytest.raises(TypeError, match=r"policy=<class 'str'> must be a subclass of EvictionPolicy"):
        register_eviction_policy(str)  # type: ignore[type-var]
    with pytest.raises(ValueError, match=r"Nameless.name='' must be a non-empty str"):
        register_eviction_policy(Nameless)
    with pytest.raises(ValueError, match=r"eviction_policy='lru' is taken by LruPolicy"):
        register_eviction_policy(Impostor)
    with pytest.raises(ValueError, match=r"name='lru' is a built-in eviction policy"):
        unregister_eviction_policy("lru")
    with pytest.raises(ValueError, match=r"name='mru' is not a registered eviction policy"):
        unregister_eviction_policy("mru")
    assert register_eviction_policy(LruPolicy) is LruPolicy  # (the same class again: nothing changes)
    assert dict(EVICTION_POLICIES) == before
