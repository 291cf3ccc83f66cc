"""One lifecycle: a `KVCacheCoordinator` of one full-attention group and a `BlockManager` serve the same
traffic identically (hits, errors, page tables, evictions, metrics) under every eviction policy, leaves-first
eviction, request retention priorities, pinned prefixes and queue-aware retention. The two are held to each other so that every feature works the
same whichever bookkeeping serves the model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import Retention, TextContext
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import FullAttentionManager
from pagedkv.core.pool import EVICTION_POLICIES

PAGE = 4


def pair(
    policy: str, leaves: bool, pages: int, scheduled: bool = False, partial: bool = False
) -> tuple[BlockManager, KVCacheCoordinator]:
    kwargs = dict(enable_prefix_caching=True, eviction_policy=policy, evict_leaves_first=leaves,
                  commit_on_alloc=scheduled, partial_page_reuse=partial)  # fmt: skip
    one = BlockManager(pages, PAGE, **kwargs)  # type: ignore[arg-type]
    return one, KVCacheCoordinator(pages, PAGE, [FullAttentionManager(0, PAGE)], **kwargs)  # type: ignore[arg-type]


def replay(
    bm: BlockManager | KVCacheCoordinator,
    seed: int,
    scheduled: bool = False,
    swaps: bool = False,
    lengths: tuple[int, ...] = (8, 12, 17),
) -> list[object]:
    """A seeded mix of shared-prefix prompts (prefixes of `lengths` tokens) with retention priorities: up to 3
    running at once, each prefilled then decoded a few tokens, released in random order (with `swaps`, some
    swapped out instead: snapshot and release, later restored and recommitted, then decoded on). Partial-page
    copies are taken after each admission (before the forward pass). Returns what every call observed."""
    rng = random.Random(seed)
    swapped: dict[int, tuple[TextContext, object]] = {}
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.choice(lengths))] for _ in range(4)]
    running: dict[int, TextContext] = {}
    seen: list[object] = []
    queue = []
    for rid in range(64):
        tokens = [*rng.choice(prefixes), *[rng.randrange(1, 500) for _ in range(rng.randrange(1, 9))]]
        queue.append(TextContext(rid, np.array(tokens)))
        if rng.random() < 0.4:
            queue[-1].retention = Retention(rng.choice([10, 60, 90]), rng.choice([None, 5.0]))
    for rid in range(60):
        ctx = queue[rid]
        for r in sorted(swapped):  # swapped-out requests come back when the pool has room
            if rng.random() < 0.5:
                continue
            c, record = swapped[r]
            before = (bm.pool.free_order(), bm.pool.num_cached, bm.request_ids())
            try:
                todo = bm.swap_restore(c, record)  # type: ignore[arg-type]
            except InsufficientBlocksError as error:
                assert (bm.pool.free_order(), bm.pool.num_cached, bm.request_ids()) == before
                seen.append(("in-full", r, str(error)))
                continue
            seen.append(("in", r, todo, bm.get_req_blocks(r)))
            bm.swap_recommit(c, record)  # type: ignore[arg-type]
            seen.append(("recommit", r, bm.get_req_blocks(r), bm.pool.num_cached))
            del swapped[r]
            running[r] = c
        if rng.random() < 0.5:  # the scheduler tells the manager its waiting queue's head
            seen.append(("expect", bm.expect(queue[rid : rid + rng.randrange(1, 5)])))
        if rng.random() < 0.1:
            seen.append(("pin", bm.pin_prefix(rng.choice(prefixes), Retention(rng.choice([35, 100])))))
        bm.claim(rid)
        chunk = rng.choice([None, 5, 9]) if scheduled else None  # a chunked prefill tells alloc its chunk
        try:
            bm.alloc(ctx, chunk)
            if chunk is not None and chunk < ctx.tokens.active_length:
                ctx.tokens.chunk(chunk)
        except InsufficientBlocksError as error:
            seen.append(("full", rid, str(error)))
            bm.release(rid)
        else:
            seen.append(("hit", rid, ctx.cached_prefix_length, bm.get_req_blocks(rid)))
            seen.append(("copies", bm.take_page_copies()))
            running[rid] = ctx
        for r, c in list(running.items()):
            if c.tokens.is_chunked:  # the rest of a chunked prompt runs next
                c.tokens.advance_chunk()
                bm.step(c)
                bm.alloc(c)
                seen.append(("chunk", r, c.cached_prefix_length, bm.get_req_blocks(r)))
                continue
            c.update(rng.randrange(1, 500))
            bm.step(c)
            try:
                bm.alloc(c)
            except InsufficientBlocksError:
                seen.append(("decode-full", r))
                bm.release(r)
                del running[r]
                continue
            seen.append(("decode", r, bm.get_req_blocks(r)))
        while len(running) > 2 or (running and rng.random() < 0.3):
            r = rng.choice(sorted(running))
            if swaps and rng.random() < 0.5:  # preempted by swap: its pages copied out, then released
                pages, record = bm.swap_snapshot(r)
                seen.append(("out", r, pages, record.num_pages))
                swapped[r] = (running[r], record)
            bm.release(r)
            del running[r]
        bm.check_integrity()
        seen.append(("pool", bm.pool.num_free, bm.pool.num_cached, bm.pool.num_evictions))
    m = bm.metrics
    seen.append(("metrics", m.input_tokens, m.cache_tokens, m.evictions))
    return seen


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_preemption_is_the_same_on_both(policy: str, seed: int, scheduled: bool) -> None:
    """Requests swapped out (snapshot, release) and later restored and recommitted: the same fresh pages,
    (index in the snapshot's page list, page) pairs to copy back, device-cached prefix pages reused and tables
    on both, call for call."""
    one, coordinator = pair(policy, False, pages=24, scheduled=scheduled)
    expected = replay(one, seed, scheduled, swaps=True)
    assert replay(coordinator, seed, scheduled, swaps=True) == expected
    restores = [e for e in expected if e[0] == "in"]
    assert any(len(e[2]) < len(e[3]) for e in restores)  # type: ignore[arg-type]  # cached prefix pages reused
    assert any(e[2] for e in restores)  # and fresh pages to copy back


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schedule_time_caching_is_the_same_on_both(seed: int) -> None:
    """`commit_on_alloc`: pages committed at alloc (chunked prefills told their chunk), announced at step,
    forgotten when released unwritten: the one-group coordinator and BlockManager agree call for call."""
    one, coordinator = pair("lru", False, pages=24, scheduled=True)
    expected = replay(one, seed, scheduled=True)
    assert replay(coordinator, seed, scheduled=True) == expected
    assert any(e[0] == "chunk" for e in expected)


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_page_reuse_is_the_same_on_both(scheduled: bool, policy: str, seed: int) -> None:
    """`partial_page_reuse`: a hit also copies the matching tokens of a cached last partial page (copy-on-write,
    `take_page_copies`), with or without `commit_on_alloc`: the same copies, skipped tokens and metrics."""
    one, coordinator = pair(policy, False, pages=24, scheduled=scheduled, partial=True)
    expected = replay(one, seed, scheduled, lengths=(6, 10, 17))
    assert replay(coordinator, seed, scheduled, lengths=(6, 10, 17)) == expected
    assert sum(len(e[1]) for e in expected if e[0] == "copies") > 3  # type: ignore[arg-type]
    assert any(e[0] == "hit" and e[2] % PAGE for e in expected)  # a partial hit skipped a page's first tokens


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@pytest.mark.parametrize("leaves", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_group_coordinator_serves_as_the_block_manager(policy: str, leaves: bool, seed: int) -> None:
    one, coordinator = pair(policy, leaves, pages=24)
    expected = replay(one, seed)
    assert replay(coordinator, seed) == expected
    assert sum(1 for e in expected if e[0] == "hit" and e[2]) > 10  # the traffic hits and evicts
    assert expected[-2][3] > 0  # type: ignore[index]


def test_pages_committed_at_alloc_and_swapped_out_unwritten_are_not_recommitted() -> None:
    """`commit_on_alloc`: a request swapped out between its alloc and its step holds pages committed at alloc
    whose KV was never written; its restore must not put them back in the prefix cache (both alike)."""
    seen = []
    for bm in pair("lru", False, pages=16, scheduled=True):
        a = TextContext("a", np.arange(1, 14))  # 13 tokens: pages 0-2 committed at alloc
        bm.claim("a")
        bm.alloc(a)
        pages, record = bm.swap_snapshot("a")
        bm.release("a")
        assert record.committed == 0 and bm.pool.num_cached == 0
        todo = bm.swap_restore(a, record)
        bm.swap_recommit(a, record)
        assert [i for i, _ in todo] == [0, 1, 2, 3] and bm.pool.num_cached == 0  # nothing written: all copied
        bm.check_integrity()
        bm.release("a")  # never stepped
        assert bm.pool.num_cached == 0
        seen.append((pages, todo))
    assert seen[0] == seen[1]
