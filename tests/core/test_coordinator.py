"""KVCacheCoordinator: several groups over one pool, with exact page ids, drops, hits and failures."""

from __future__ import annotations

import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    SinkAttentionManager,
    SlidingWindowManager,
)

N = 30  # pool pages; the null page id is 30


def coordinator(*groups, num_blocks: int = N, caching: bool = True) -> KVCacheCoordinator:
    return KVCacheCoordinator(num_blocks, 4, list(groups), enable_prefix_caching=caching)


def run(c: KVCacheCoordinator, context, tokens: list[int]) -> None:
    """One forward per token: alloc, update, step (and check the invariants)."""
    for token in tokens:
        c.alloc(context)
        context.update(token)
        c.step(context)
        c.check_integrity()


def test_sliding_window_returns_out_of_window_pages() -> None:
    c = coordinator(FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6))
    a = ctx("a", range(10))
    c.claim("a")
    c.alloc(a)  # 10 tokens: 3 pages in each group
    assert c.get_req_blocks("a", 0) == [0, 1, 2] and c.get_req_blocks("a", 1) == [3, 4, 5]
    run(c, a, [100])
    c.alloc(a)  # processed 10: a query at 10 sees keys 5..10, so page 0 (tokens 0-3) goes back
    assert c.get_req_blocks("a", 1) == [N, 4, 5]
    run(c, a, [101, 102, 103])  # token 12 opened page 3 in both groups
    assert c.get_req_blocks("a", 0) == [0, 1, 2, 6] and c.get_req_blocks("a", 1) == [N, 4, 5, 7]
    assert c.pool.num_used == 7 and c.pool.free_order()[-1] == 3  # the dropped page keeps its hash (protected)
    c.release("a")
    assert c.pool.num_used == 0
    c.check_integrity()


def test_hit_takes_only_the_window_before_the_resume_point() -> None:
    c = coordinator(FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6))
    a = ctx("a", range(17))
    c.claim("a")
    run(c, a, [1])  # pages 0-3 of both groups committed (tokens 0-15)
    full, window = c.get_req_blocks("a", 0), c.get_req_blocks("a", 1)
    c.release("a")
    b = ctx("b", range(17))
    c.claim("b")
    c.alloc(b)  # resume at 16: the window needs tokens 11..15, pages 2 and 3; pages 0-1 stay null
    assert b.tokens.processed_length == 16 and b.cached_prefix_length == 16
    assert c.get_req_blocks("b", 0)[:4] == full[:4]
    assert c.get_req_blocks("b", 1)[:4] == [N, N, *window[2:4]]
    c.check_integrity()


def test_no_hit_without_the_window() -> None:
    c = coordinator(FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6))
    a = ctx("a", range(17))
    c.claim("a")
    run(c, a, [1])
    c.reset_prefix_cache()  # nothing evictable yet: a still holds its pages
    c.release("a")
    c.reset_prefix_cache()  # now every cached page is forgotten
    b = ctx("b", range(17))
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0
    c.check_integrity()


def test_chunked_local_drops_finished_chunks() -> None:
    c = coordinator(ChunkedLocalAttentionManager(0, 4, 8))
    a = ctx("a", range(7))
    c.claim("a")
    run(c, a, list(range(10)))  # 17 tokens, processed 16
    assert c.get_req_blocks("a") == [N, N, 2, 3]  # the last alloc (at 15) saw chunk [8, 16)
    c.alloc(a)  # position 16 starts a new chunk: pages 2 and 3 go too
    assert c.get_req_blocks("a") == [N, N, N, N, 4]
    c.check_integrity()


def test_sinks_keep_the_first_pages() -> None:
    c = coordinator(SinkAttentionManager(0, 4, window=4, sinks=3))
    a = ctx("a", range(6))
    c.claim("a")
    run(c, a, list(range(12)))  # 18 tokens, the last query (16) saw 13..16 and the sinks 0..2
    assert c.get_req_blocks("a") == [0, N, N, 3, 4]  # page 0 holds the sinks
    c.check_integrity()


def test_cross_attention_pages_once_per_request() -> None:
    c = coordinator(FullAttentionManager(0, 4), CrossAttentionManager(1, 4))
    a = ctx("a", [5], encoder_length=9)
    c.claim("a")
    run(c, a, [1, 2, 3, 4, 5])
    assert c.get_req_blocks("a", 1) == [1, 2, 3] and c.get_req_blocks("a", 0) == [0, 4]
    tables = c.build_group_tables([a])
    assert tables[1].cache_lengths.tolist() == [9] and tables[1].lookup_table[0, :4].tolist() == [1, 2, 3, N]
    assert tables[0].cache_lengths.tolist() == [5]
    assert (tables[1].max_prompt_length, tables[1].max_cache_length) == (1, 9)  # one decoder query, 9 encoder keys
    assert (tables[0].max_prompt_length, tables[0].max_cache_length) == (1, 6)
    assert c.pool.ref_count(1) == 1 and c.pool.block_hash(1) is None  # never prefix-cached
    c.check_integrity()


def test_failed_alloc_changes_nothing() -> None:
    c = coordinator(FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6), num_blocks=5)
    a = ctx("a", range(10))
    c.claim("a")
    before = snapshot(c, a)
    with pytest.raises(InsufficientBlocksError, match="Cannot get 6 free blocks for request 'a' \\(only 5 available"):
        c.alloc(a)
    assert snapshot(c, a) == before
    c.check_integrity()


def test_decode_fast_path_moves_only_the_counter() -> None:
    c = coordinator(FullAttentionManager(0, 4), SlidingWindowManager(1, 4, 6))
    a = ctx("a", range(5))
    c.claim("a")
    run(c, a, [1])  # 6 tokens, 2 pages each; the next drop comes at processed 9
    before = snapshot(c)
    c.alloc(a)
    after = snapshot(c)
    assert after["metrics"].input_tokens == before["metrics"].input_tokens + 1
    after["metrics"], before["metrics"] = None, None
    assert after == before


def test_a_page_after_a_dropped_entry_commits_under_a_keyed_order() -> None:
    """A window group's page whose previous entry was dropped (null) commits chained to no parent (it used to
    index the null page in the keyed eviction order: IndexError)."""
    c = KVCacheCoordinator(N, 2, [FullAttentionManager(0, 2), ChunkedLocalAttentionManager(1, 2, 6)],
                           enable_prefix_caching=True)  # fmt: skip
    c.pool.keyed_order()
    a = ctx("a", range(7))
    c.claim("a")
    run(c, a, [1, 2, 3])  # at processed 7 the chunk group drops pages 0..2; page 3 commits at processed 8
    assert c.get_req_blocks("a", 1)[:3] == [N, N, N] and c.pool.block_hash(c.get_req_blocks("a", 1)[3]) is not None
