"""Queue-aware retention: the cached pages waiting requests will hit are evicted last, those of requests further
back in the queue first (`BlockPool.want`, `BlockManager.expect`). Exact page ids, torch-free."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.core.pool import BlockPool

PS = 4


def ctx(rid: str, tokens: list[int]) -> TextContext:
    return TextContext(rid, np.asarray(tokens))


def serve(bm: BlockManager, c: TextContext) -> int:
    """Claim, alloc, write every token, step, release; returns the cached prefix at admission."""
    bm.claim(c.request_id)
    bm.alloc(c)
    hit = c.cached_prefix_length
    c.update(7)
    bm.step(c)
    bm.release(c.request_id)
    bm.check_integrity()
    return hit


def prompt(base: int) -> list[int]:
    return list(range(base, base + 2 * PS + 1))  # two full pages and one token


def test_pool_evicts_unwanted_pages_first_then_the_latest_wanted() -> None:
    pool = BlockPool(6)
    pages = pool.allocate(6)
    for i, page in enumerate(pages):
        pool.commit(page, bytes([i]) * 32)
    pool.free(pages)  # LRU order: pages[0] (oldest) ... pages[5]
    pool.want([bytes([0]) * 32, bytes([1]) * 32], ticket=2)  # the second request in the queue
    pool.want([bytes([2]) * 32], ticket=1)  # the first
    assert pool.allocate(3) == [pages[3], pages[4], pages[5]]  # nobody wants these: they go first
    assert pool.allocate(2) == [pages[0], pages[1]]  # then what the later request wants
    assert pool.allocate(1) == [pages[2]]


def test_withdrawn_wants_restore_the_policy_order() -> None:
    pool = BlockPool(3)
    pages = pool.allocate(3)
    for i, page in enumerate(pages):
        pool.commit(page, bytes([i]) * 32)
    pool.free(pages)
    pool.want([bytes([0]) * 32], ticket=1)
    pool.want([bytes([0]) * 32], ticket=1, delta=-1)
    assert pool.num_wanted == 0
    assert pool.allocate(1) == [pages[0]]  # LRU again


def cached(bm: BlockManager, tokens: list[int]) -> int:
    """Leading full pages of `tokens` the prefix cache holds."""
    n = (len(tokens) - 1) // PS
    keys, _ = bm.hasher.extend(np.asarray(tokens), 0, n, bm.hasher.root(None))
    return len(bm.pool.lookup(keys, 0, n))


@pytest.mark.parametrize("expect", [False, True])
def test_a_waiting_request_keeps_its_prefix_while_others_are_served(expect: bool) -> None:
    """Two prompts of 2 full pages are cached (A's older) beside 3 fresh pages. A waits for A's prefix; a stranger
    needing 5 pages is served first: LRU evicts A's pages, queue-aware retention B's."""
    bm = BlockManager(7, PS, enable_prefix_caching=True)
    assert serve(bm, ctx("a", prompt(100))) == 0
    assert serve(bm, ctx("b", prompt(200))) == 0
    waiting = ctx("a2", prompt(100))
    if expect:
        assert bm.expect([waiting]) == 1
        assert bm.expect([waiting]) == 0  # known already
    bm.claim("s")
    bm.alloc(ctx("s", list(range(300, 300 + 5 * PS))))  # 3 fresh pages, then 2 evicted
    bm.check_integrity()
    assert (cached(bm, prompt(100)), cached(bm, prompt(200))) == ((2, 0) if expect else (0, 2))
    bm.release("s")
    assert serve(bm, waiting) == (2 * PS if expect else 0)
    assert bm.pool.num_wanted == 0  # the want ended at a2's admission


def test_a_request_requeued_at_the_front_is_kept_before_those_behind_it() -> None:
    """The queue is [c, b] when first told, then [a, c, b] (a preempted request goes back to the front): a's
    ticket is lower than c's, so b's pages (the last) go first, then c's, and a's last."""
    bm = BlockManager(9, PS, enable_prefix_caching=True)
    for name, base in (("a", 100), ("b", 200), ("c", 300)):
        serve(bm, ctx(name, prompt(base)))
    bm.expect([ctx("c2", prompt(300)), ctx("b2", prompt(200))])
    bm.expect([ctx("a2", prompt(100)), ctx("c2", prompt(300)), ctx("b2", prompt(200))])
    bm.claim("s")
    bm.alloc(ctx("s", list(range(400, 400 + 5 * PS))))  # 5 pages: 3 fresh, then b's 2
    assert [cached(bm, prompt(base)) for base in (100, 300, 200)] == [2, 2, 0]
    bm.release("s")
    bm.claim("t")
    bm.alloc(ctx("t", list(range(500, 500 + 7 * PS))))  # 7 pages: the stranger's 5, then c's 2
    assert [cached(bm, prompt(base)) for base in (100, 300, 200)] == [2, 0, 0]
    bm.release("t")
    bm.check_integrity()


def test_expect_ignores_running_and_resumed_requests_and_caching_off() -> None:
    bm = BlockManager(8, PS, enable_prefix_caching=True)
    running = ctx("r", prompt(100))
    bm.claim("r")
    bm.alloc(running)
    resumed = ctx("w", prompt(100))
    resumed.tokens.skip_processing(PS)  # a swapped-out request keeps its progress
    assert bm.expect([running, resumed]) == 0 and bm.pool.num_wanted == 0
    off = BlockManager(8, PS, enable_prefix_caching=False)
    assert off.expect([ctx("x", prompt(100))]) == 0
    with pytest.raises(TypeError, match="contexts holds list, expected TextContext"):
        bm.expect([[1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="contexts holds str, expected TextContext"):  # (a one-pass iterable too)
        bm.expect(c for c in [ctx("y", prompt(300)), "z"])  # type: ignore[misc]
    assert bm.pool.num_wanted == 0  # (nothing of the refused call stays)
    bm.release("r")
    bm.check_integrity()


def test_a_swapped_request_recomputed_where_it_stands_is_wanted_from_then_on() -> None:
    """A swapped-out request waits without a want (it resumes where it stopped); reset in place for recomputation,
    the next `expect` wants its prefix, even though the queue only grew behind it: a stranger then evicts the
    unwanted pages, not its three."""
    bm = BlockManager(8, PS, enable_prefix_caching=True)
    p = ctx("p", list(range(100, 100 + 3 * PS + 1)))
    serve(bm, p)  # its 3 full pages cached; it keeps its progress (swapped out)
    serve(bm, ctx("q", list(range(500, 500 + 3 * PS + 1))))  # a newer prompt nobody waits for
    a = ctx("a", list(range(200, 200 + 3 * PS + 1)))
    assert bm.expect([p, a]) == 1  # p is started: no want
    p.reset()
    assert bm.expect([p, a, ctx("n", list(range(300, 300 + 3 * PS + 1)))]) == 2  # p and the newcomer
    bm.claim("x")
    bm.alloc(ctx("x", list(range(900, 900 + 3 * PS + 1))))  # 4 pages: 2 fresh, then 2 of q's (LRU would take p's)
    assert cached(bm, list(range(100, 100 + 3 * PS + 1))) == 3
    assert cached(bm, list(range(500, 500 + 3 * PS + 1))) == 1  # (q's tail pages went: freed tail first)
    bm.release("x")
    bm.check_integrity()


def test_unexpect_ends_a_want_of_a_request_that_leaves_the_queue() -> None:
    bm = BlockManager(8, PS, enable_prefix_caching=True)
    serve(bm, ctx("a", prompt(100)))
    bm.expect([ctx("a2", prompt(100))])
    assert bm.pool.num_wanted == 2
    bm.unexpect("a2")
    bm.unexpect("a2")  # (no-op)
    assert bm.pool.num_wanted == 0


@pytest.mark.parametrize("expect", [False, True])
def test_a_hybrid_coordinator_keeps_a_waiting_requests_pages_in_every_group(expect: bool) -> None:
    """Two full-attention groups share one pool (two pages per prefix page). A and B are cached (A older, 4 pages
    each), 6 pages are fresh; a stranger of 5 pages a group (10) evicts 4: LRU takes A's, queue-aware retention
    B's."""
    from pagedkv.core.coordinator import KVCacheCoordinator
    from pagedkv.core.groups import FullAttentionManager

    c = KVCacheCoordinator(14, PS, [FullAttentionManager(0, PS), FullAttentionManager(1, PS)],
                           enable_prefix_caching=True)  # fmt: skip

    def serve_c(rid: str, tokens: list[int]) -> int:
        context = ctx(rid, tokens)
        c.claim(rid)
        c.alloc(context)
        hit = context.cached_prefix_length
        context.update(7)
        c.step(context)
        c.release(rid)
        c.check_integrity()
        return hit

    serve_c("a", prompt(100))
    serve_c("b", prompt(200))
    if expect:
        assert c.expect([ctx("a2", prompt(100))]) == 1
    c.claim("s")
    c.alloc(ctx("s", list(range(300, 300 + 5 * PS))))
    c.release("s")
    assert serve_c("a2", prompt(100)) == (2 * PS if expect else 0)
    assert c.wants.entries == {}


def test_a_set_aside_page_nobody_wants_any_more_goes_first() -> None:
    """Eviction passes a wanted page and sets it aside; when its want ends it is the oldest free page, so it goes
    before every page still listed (as the keyed order, where its rank drops back, evicts it)."""
    pool = BlockPool(4)
    pages = pool.allocate(4)
    for i, page in enumerate(pages):
        pool.commit(page, bytes([i]) * 32)
    pool.free(pages)
    pool.want([bytes([0]) * 32], ticket=1)
    assert pool.allocate(1) == [pages[1]]  # pages[0] is set aside
    pool.check_integrity({pages[1]: 1})
    pool.want([bytes([0]) * 32], ticket=1, delta=-1)
    assert pool.free_order() == [pages[0], pages[2], pages[3]]
    assert pool.allocate(2) == [pages[0], pages[2]]


@pytest.mark.parametrize("seed", range(8))
def test_lazy_wants_evict_exactly_as_the_keyed_order(seed: int) -> None:
    """The list policy keeps wants lazily (`WantedPages`); the keyed `HeapOrder` ranks every free page. Under LRU
    both give the same eviction order: random commits (with duplicate keys), frees, hits, wants and withdrawals,
    pins, uncaching and resets on one pool of each kind give the same pages, and `free_order` predicts them."""
    import collections
    import random

    rng = random.Random(seed)
    lazy, keyed = BlockPool(24), BlockPool(24)
    keyed.keyed_order()
    held: collections.Counter[int] = collections.Counter()
    pins: list[list[tuple[int, int]]] = []
    wants: list[tuple[list[bytes], float]] = []
    keys = [bytes([k]) * 32 for k in range(40)]
    for _ in range(600):
        op = rng.random()
        free = lazy.num_free - lazy.num_protected
        if op < 0.25 and free:
            n = rng.randint(1, min(4, free))
            predicted = lazy.free_order()[:n]
            got = lazy.allocate(n)
            other = keyed.allocate(n)
            assert got == other == predicted, (got, other, predicted)
            for page in got:
                held[page] += 1
                key = rng.choice(keys)
                if rng.random() < 0.8 and lazy.cached_page(key) is None:
                    assert lazy.commit(page, key) == keyed.commit(page, key) == page
        elif op < 0.45 and held:
            pages = rng.sample(sorted(held), rng.randint(1, min(3, len(held))))
            for page in pages:
                held[page] -= 1
                held += collections.Counter()  # (drops zero counts)
            lazy.free(pages)
            keyed.free(pages)
        elif op < 0.55:
            page = lazy.cached_page(rng.choice(keys))
            if page is not None:
                lazy.touch([page])
                keyed.touch([page])
                held[page] += 1
        elif op < 0.75:
            want = (rng.sample(keys, rng.randint(1, 5)), float(rng.randint(1, 6)))
            lazy.want(*want)
            keyed.want(*want)
            wants.append(want)
        elif op < 0.88 and wants:
            want = wants.pop(rng.randrange(len(wants)))
            lazy.want(*want, delta=-1)
            keyed.want(*want, delta=-1)
        elif op < 0.92:
            cached = [p for p in (lazy.cached_page(k) for k in keys) if p is not None]
            if cached:
                chosen = rng.sample(cached, min(2, len(cached)))
                pins.append(lazy.pin(chosen))
                keyed.pin(chosen)
        elif op < 0.95 and pins:
            pinned = pins.pop(rng.randrange(len(pins)))
            lazy.unpin(pinned)
            keyed.unpin(pinned)
        elif op < 0.97:
            assert lazy.reset_prefix_cache() == keyed.reset_prefix_cache()
        else:
            cached = [p for p in (lazy.cached_page(k) for k in keys) if p is not None]
            chosen = rng.sample(cached, min(2, len(cached)))
            assert lazy.uncache(chosen) == keyed.uncache(chosen)
        live_pins = collections.Counter(p for pinned in pins for p, stamp in pinned if lazy.stamp(p) == stamp)
        lazy.check_integrity(held, live_pins)
        keyed.check_integrity(held, live_pins)
        assert lazy._order is None
        assert [lazy.cached_page(k) for k in keys] == [keyed.cached_page(k) for k in keys]
