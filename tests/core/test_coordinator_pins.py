"""KVCacheCoordinator pins: a running request's dropped window pages stay cached and protected,
so its prefix remains hittable in every group (exact page ids; invariants checked throughout)."""

from __future__ import annotations

import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import FullAttentionManager, SlidingWindowManager

N = 30  # the null page id when num_blocks=30


def coordinator(num_blocks: int = N, fraction: float = 1.0) -> KVCacheCoordinator:
    """Full attention + a 6-token sliding window, pages of 4 tokens, prefix caching on."""
    groups = [FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6)]
    return KVCacheCoordinator(num_blocks, 4, groups, enable_prefix_caching=True, protected_fraction=fraction)


def run(c: KVCacheCoordinator, context, tokens: list[int]) -> None:
    for token in tokens:
        c.alloc(context)
        context.update(token)
        c.step(context)
        c.check_integrity()


def started(c: KVCacheCoordinator):
    """Request 'a': 10 prompt tokens, one decode; its window page 3 (tokens 0-3) is dropped (null)."""
    a = ctx("a", range(10))
    c.claim("a")
    run(c, a, [100])
    c.alloc(a)
    assert c.get_req_blocks("a", 0) == [0, 1, 2] and c.get_req_blocks("a", 1) == [c.pool.null_block, 4, 5]
    return a


def test_dropped_cached_page_is_protected_from_other_requests() -> None:
    c = coordinator(7)
    started(c)
    assert c.pool.is_protected(3) and c.pool.pin_count(3) == 1 and c.pool.free_order() == [6, 3]
    b = ctx("b", [50, 51, 52])
    c.claim("b")
    before = snapshot(c, b)
    with pytest.raises(InsufficientBlocksError, match=r"Cannot get 2 free blocks for request 'b' \(only 1 available"):
        c.alloc(b)
    assert snapshot(c, b) == before
    c.release("a")  # the pin goes: page 3 is an ordinary cached page again
    assert not c.pool.is_protected(3)
    c.alloc(b)  # a's unhashed pages 2 and 5 went to the fresh stack, 5 last: they come back first
    assert c.get_req_blocks("b", 0) == [5] and c.get_req_blocks("b", 1) == [2]
    c.check_integrity()


def test_without_protection_others_evict_dropped_pages() -> None:
    c = coordinator(7, fraction=0.0)
    started(c)
    assert not c.pool.is_protected(3) and c.pool.pin_count(3) == 1
    b = ctx("b", [50, 51, 52])
    c.claim("b")
    c.alloc(b)
    assert c.get_req_blocks("b", 0) == [6] and c.get_req_blocks("b", 1) == [3] and c.pool.num_evictions == 1
    c.check_integrity()
    c.release("a")  # its pin on page 3 is stale: nothing to undo
    c.check_integrity()


def test_a_request_alone_recycles_its_own_protected_pages() -> None:
    c = coordinator(8)
    a = ctx("a", range(10))
    c.claim("a")
    run(c, a, list(range(100, 110)))  # 20 tokens: 5 full pages + the window need more than 8
    null = c.pool.null_block
    assert c.get_req_blocks("a", 0) == [0, 1, 2, 6, 4] and c.get_req_blocks("a", 1) == [null, null, null, 7, 3]
    assert c.pool.num_evictions == 2 and c.pool.free_order() == [5] and c.pool.is_protected(5)


def test_with_another_request_holding_pages_it_fails_instead() -> None:
    c = coordinator(10)
    x = ctx("x", [70, 71])
    c.claim("x")
    c.alloc(x)
    a = ctx("a", range(10))
    c.claim("a")
    run(c, a, list(range(100, 107)))
    before = snapshot(c, a, x)
    with pytest.raises(InsufficientBlocksError, match=r"Cannot get 2 free blocks for request 'a' \(only 0 available"):
        c.alloc(a)  # the caller preempts (x or a); a's prefix stays whole meanwhile
    assert snapshot(c, a, x) == before and c.pool.free_order() == [5, 6] and c.pool.num_protected == 2


def test_a_hit_pins_the_cached_pages_before_its_window() -> None:
    c = coordinator()
    a = ctx("a", range(17))
    c.claim("a")
    run(c, a, [1])
    window = c.get_req_blocks("a", 1)
    assert window == [5, 6, 7, 8, 9]
    c.release("a")
    b = ctx("b", range(17))
    c.claim("b")
    c.alloc(b)  # resume at 16: the window reads pages 2-3; pages 0-1 are pinned, not held
    assert c.get_req_blocks("b", 1) == [N, N, 7, 8, 4]
    assert [(c.pool.pin_count(p), c.pool.is_protected(p)) for p in window[:3]] == [(1, True), (1, True), (0, False)]
    c.check_integrity()
    c.release("b")
    assert c.pool.num_protected == 0
    c.check_integrity()


def test_pins_outlive_other_holders() -> None:
    c = coordinator()
    started(c)
    b = ctx("b", range(10))  # same prompt: hits pages 0-1 (full) and 3-4 (window)
    c.claim("b")
    c.alloc(b)
    assert c.get_req_blocks("b", 0)[:2] == [0, 1] and c.get_req_blocks("b", 1)[:2] == [3, 4]
    c.release("b")  # page 3 is free again, still pinned by a: protected, not in the LRU
    assert c.pool.is_protected(3) and c.pool.pin_count(3) == 1
    c.release("a")
    assert not c.pool.is_protected(3) and c.pool.free_order()[-3:] == [4, 0, 3]
    c.check_integrity()
