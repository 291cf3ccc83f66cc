"""Partial-page reuse (``partial_page_reuse=True``): exact skips, sources, copies and failures."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ctx, snapshot
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError, IntegrityError
from pagedkv.core.partial_pages import PageCopy


def manager(num_blocks: int = 128, page: int = 16, partial: bool = True) -> BlockManager:
    return BlockManager(num_blocks, page, enable_prefix_caching=True, partial_page_reuse=partial)


def run(bm: BlockManager, c: TextContext, tokens: list[int]) -> None:
    """claim `c`, then one forward per token: alloc, take the copies (the forward applies them), update, step."""
    bm.claim(c.request_id)
    for token in tokens:
        bm.alloc(c)
        bm.take_page_copies()
        c.update(token)
        bm.step(c)
        bm.check_integrity()


@pytest.mark.parametrize("partial,cached", [(False, 992), (True, 1000)])
def test_a_1000_of_1010_token_hit_skips_1000(partial: bool, cached: int) -> None:
    bm = manager(partial=partial)
    base = np.random.default_rng(0).integers(0, 1000, 1010)
    run(bm, ctx("a", base), [7])  # 63 full pages (tokens 0..1007) committed
    a_pages = bm.get_req_blocks("a")
    b = ctx("b", [*base[:1000], *range(5000, 5010)])
    bm.claim("b")
    bm.alloc(b)
    assert (b.cached_prefix_length, b.tokens.processed_length, b.tokens.active_length) == (
        cached,
        cached,
        1010 - cached,
    )
    pages = bm.get_req_blocks("b")
    assert pages[:62] == a_pages[:62] and len(pages) == 64 and not set(pages[62:]) & set(a_pages)
    assert bm.metrics.cache_tokens == cached
    bm.check_integrity()
    if not partial:
        assert bm.take_page_copies() == [] and bm._partial is None
        return
    assert bm._partial is not None and bm.pool.ref_count(a_pages[62]) == 2  # a's table + the pending copy
    assert bm.take_page_copies() == [PageCopy(a_pages[62], pages[62], 8)] == [(a_pages[62], pages[62], 8)]
    assert bm.pool.ref_count(a_pages[62]) == 1 and bm.take_page_copies() == []
    bm.check_integrity()


def test_the_last_token_is_always_computed() -> None:
    bm = manager(page=16)
    tokens = list(range(100, 140))
    run(bm, ctx("a", tokens), [7])  # pages 0, 1 (tokens 0..31) committed
    whole = ctx("b", tokens[:32])  # two full pages: page 0 hits, page 1 copies 15 of 16 tokens
    bm.claim("b")
    bm.alloc(whole)
    assert (whole.cached_prefix_length, whole.tokens.active_length) == (31, 1)
    for rid, end, chunk, cached in (("c", 20, 10, 9), ("d", 20, 18, 17)):
        c = ctx(rid, tokens[:end])
        c.tokens.chunk(chunk)  # the window's last token is computed too
        bm.claim(rid)
        bm.alloc(c)
        assert (c.tokens.processed_length, c.tokens.active_length) == (cached, 1)
    assert [m for _, _, m in bm.take_page_copies()] == [15, 9, 1]
    bm.check_integrity()


def test_salts_never_match_each_other() -> None:
    bm = manager(page=16)
    run(bm, ctx("a", range(20), cache_salt="t1"), [7])  # page 0 (tokens 0..15) committed under t1's root
    for rid, salt, cached in (("same", "t1", 11), ("other", "t2", 0), ("none", None, 0)):
        c = ctx(rid, range(12), cache_salt=salt)
        bm.claim(rid)
        bm.alloc(c)
        assert c.cached_prefix_length == cached, rid
    assert len(bm.take_page_copies()) == 1
    bm.check_integrity()


def test_the_longest_of_several_children_is_copied() -> None:
    bm = manager(page=8)
    head = list(range(100, 108))  # page 0 of every request below
    tails = {"x1": [1, 2, 3, 50, 51, 52, 53, 54], "x2": [1, 2, 3, 4, 5, 6, 60, 61], "x3": [1, 2, 3, 4, 70, 71, 72, 73]}
    for rid, tail in tails.items():
        run(bm, ctx(rid, head + tail), [7])  # page 1 committed (x2, x3 themselves copied 3 and 4 tokens)
    assert len(bm._partial.index._children[bm.pool.block_hash(bm.get_req_blocks("x1")[0])]) == 3  # type: ignore[union-attr]
    r = ctx("r", head + [1, 2, 3, 4, 5, 9, 9, 9, 9])
    bm.claim("r")
    bm.alloc(r)
    assert r.cached_prefix_length == 8 + 5
    assert bm.take_page_copies() == [(bm.get_req_blocks("x2")[1], bm.get_req_blocks("r")[1], 5)]
    bm.check_integrity()


def pool_with_free_source(hog_pages: int) -> tuple[BlockManager, TextContext]:
    """8 pages of 4; a cached then released (pages 0, 1 cached-free); a hog holding `hog_pages` fresh pages;
    b shares 6 tokens: page 0 hits, page 1 (free) is the source of a 2-token copy, 2 new pages."""
    bm = manager(num_blocks=8, page=4)
    run(bm, ctx("a", range(10)), [7])
    bm.release("a")
    bm.claim("hog")
    if hog_pages:
        bm.alloc(ctx("hog", range(100, 100 + 4 * hog_pages)))
    b = ctx("b", [0, 1, 2, 3, 4, 5, 50, 51, 52, 53])
    bm.claim("b")
    return bm, b


def test_a_free_source_is_counted_and_cannot_be_evicted_before_the_copy() -> None:
    bm, b = pool_with_free_source(hog_pages=4)  # free: 2 cached + 2 fresh
    assert bm.pages_needed(b) == (2, 2)  # the hit and the source both leave the free count
    bm.alloc(b)
    assert b.cached_prefix_length == 6 and bm.pool.num_free == 0
    assert bm.pool.ref_count(1) == 1 and bm.pool.block_hash(1) is not None
    bm.release("hog")  # 4 fresh pages
    bm.claim("e")
    with pytest.raises(InsufficientBlocksError, match="only 4 available"):
        bm.alloc(ctx("e", range(200, 220)))  # 5 pages: the source is not among the evictable ones
    bm.check_integrity()
    [(src, dst, m)] = bm.take_page_copies()
    assert (src, m) == (1, 2) and dst == bm.get_req_blocks("b")[1] and bm.pool.num_free == 5
    bm.check_integrity()


def test_a_source_that_does_not_fit_is_skipped_not_failed() -> None:
    bm, b = pool_with_free_source(hog_pages=5)  # free: 2 cached + 1 fresh: exactly the hit and 2 new pages
    assert bm.pages_needed(b) == (2, 1)
    bm.alloc(b)
    assert b.cached_prefix_length == 4 and bm.take_page_copies() == []
    assert bm.get_req_blocks("b")[2] == 1  # the would-be source was evicted for b's last page
    bm.check_integrity()


def test_failed_alloc_leaves_no_trace() -> None:
    bm, b = pool_with_free_source(hog_pages=6)  # free: only the 2 cached pages
    before = snapshot(bm, b)
    with pytest.raises(InsufficientBlocksError, match="Cannot get 2 free blocks for request 'b' \\(only 1 available"):
        bm.alloc(b)
    assert snapshot(bm, b) == before
    bm.release("hog")
    bm.alloc(b)
    stale = ctx("stale", [0, 1, 2, 3, 4, 5, 9, 9])
    stale.tokens.skip_processing(5)  # pretends tokens are cached that are not
    bm.claim("stale")
    before = snapshot(bm, b, stale)
    assert before["partial"][0]  # b's copy is pending
    with pytest.raises(ValueError, match="processed_length=5 but the cache holds 0"):
        bm.alloc(stale)
    assert snapshot(bm, b, stale) == before
    bm.check_integrity()


def test_release_before_the_copy_frees_the_source() -> None:
    bm, b = pool_with_free_source(hog_pages=0)
    bm.alloc(b)
    assert bm.pool.ref_count(1) == 1 and bm._partial is not None and bm._partial.pending
    bm.release("b")
    assert bm.pool.ref_count(1) == 0 and not bm._partial.pending and bm.take_page_copies() == []
    assert bm.pool.num_free == 8 and bm.pool.block_hash(1) is not None  # still cached, evictable
    bm.check_integrity()


def test_the_destination_is_committed_later_and_serves_hits() -> None:
    bm = manager(page=4)
    run(bm, ctx("a", range(10)), [7])
    run(bm, ctx("b", [0, 1, 2, 3, 4, 5, 50, 51, 52]), [8])  # copies 2 of page 1, then commits its own page 1
    b_page = bm.get_req_blocks("b")[1]
    assert bm.pool.block_hash(b_page) is not None and b_page != bm.get_req_blocks("a")[1]
    c = ctx("c", [0, 1, 2, 3, 4, 5, 50, 99])
    bm.claim("c")
    bm.alloc(c)
    assert c.cached_prefix_length == 7 and bm.take_page_copies() == [(b_page, bm.get_req_blocks("c")[1], 3)]
    bm.check_integrity()


def test_uncached_pages_leave_the_index() -> None:
    bm = manager(num_blocks=16, page=4)
    run(bm, ctx("a", range(10)), [7])
    bm.release("a")
    assert bm._partial is not None and bm._partial.index.pages() == {0, 1}
    assert bm.reset_prefix_cache() == 2 and bm._partial.index.pages() == set() and len(bm._partial.index) == 0
    c = ctx("c", range(6))
    bm.claim("c")
    bm.alloc(c)
    assert c.cached_prefix_length == 0
    bm.check_integrity()


def test_check_integrity_catches_a_tampered_copy() -> None:
    bm, b = pool_with_free_source(hog_pages=0)
    bm.alloc(b)
    partial = bm._partial
    assert partial is not None
    good = partial.pending["b"]
    pages = bm.get_req_blocks("b")
    cases = [
        (good._replace(dst=pages[2]), "dst is not the request's page 1"),
        (good._replace(num_tokens=4), "needs 1 <= tokens < page_size=4"),
        (good._replace(src=pages[2], dst=pages[1]), "src is not cached"),
    ]
    for bad, message in cases:
        partial.pending["b"] = bad
        with pytest.raises(IntegrityError, match=message):
            bm.check_integrity()
    del partial.pending["b"]  # the source keeps a reference nobody accounts for
    with pytest.raises(IntegrityError, match="page 1: ref 1 but 0 table references"):
        bm.check_integrity()
    partial.pending["b"] = good
    bm.check_integrity()
    partial.index.remove(0)
    with pytest.raises(IntegrityError, match="child index pages \\[0\\] disagree"):
        bm.check_integrity()


def test_flag_validation() -> None:
    with pytest.raises(TypeError, match="partial_page_reuse=1 must be a bool"):
        BlockManager(8, 4, enable_prefix_caching=True, partial_page_reuse=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partial_page_reuse=True needs enable_prefix_caching=True"):
        BlockManager(8, 4, enable_prefix_caching=False, partial_page_reuse=True)
    with pytest.raises(ValueError, match="supports one KV cache group, not 2"):
        BlockManager(8, 4, enable_prefix_caching=True, num_groups=2, partial_page_reuse=True)
