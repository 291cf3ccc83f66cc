"""BlockManager: exact page ids, ref counts, lookup tables and metrics for scripted sequences."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ctx, drive, snapshot
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.hashing import hash_tokens


def manager(num_blocks: int = 128, page: int = 1, caching: bool = True, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, page, enable_prefix_caching=caching, **kwargs)


def lengths(bm: BlockManager, *cs) -> tuple[int, int]:
    t = bm.build_tables(list(cs))
    return t.max_prompt_length, t.max_cache_length


def test_basic_prefix_hit_and_commit_merge() -> None:
    bm = manager()
    a = ctx("a", range(10, 15))
    bm.claim("a")
    bm.alloc(a)
    assert bm.get_req_blocks("a") == [0, 1, 2, 3, 4] and lengths(bm, a) == (5, 5)
    for i in range(3):  # decode: pages 5, 6, 7 for tokens 100, 101, 102
        a.update(100 + i)
        bm.step(a)
        bm.alloc(a)
        assert lengths(bm, a) == (1, 5 + i + 1)
    assert bm.get_req_blocks("a") == list(range(8))
    b = ctx("b", range(10, 14))
    bm.claim("b")
    bm.alloc(b)  # hashes cover tokens[:3]: 3 hits, token 13 recomputed in a new page
    assert bm.get_req_blocks("b") == [0, 1, 2, 8] and lengths(bm, b) == (1, 4)
    assert b.cached_prefix_length == 3 and b.tokens.processed_length == 3
    b.update(7)
    bm.step(b)  # page 8 holds the same prefix as page 3: merged, 8 freed
    assert bm.get_req_blocks("b") == [0, 1, 2, 3]
    assert [bm.pool.ref_count(p) for p in range(9)] == [2, 2, 2, 2, 1, 1, 1, 1, 0]
    assert bm.pool.free_order()[0] == 8
    m = bm.metrics
    # a: 5 prompt + 3 decode tokens computed; b: 1 computed, 3 from cache.
    assert (m.input_tokens, m.cache_tokens, m.prompt_tokens) == (9, 3, 12)
    assert m.cache_hit_rate == 3 / 12 and (m.used_pages, m.total_pages, m.cached_pages) == (8, 128, 7)
    bm.check_integrity()


def test_page_size_two_decode_without_alloc() -> None:
    bm = manager(page=2)
    c = ctx("r", range(5))
    bm.claim("r")
    bm.alloc(c)
    assert bm.get_req_blocks("r") == [0, 1, 2] and lengths(bm, c) == (5, 5)
    c.update(9)
    bm.step(c)
    assert bm.get_req_blocks("r") == [0, 1, 2] and lengths(bm, c) == (1, 6)  # 6 tokens fit 3 pages
    c.update(8)
    with pytest.raises(ValueError, match="holds 3 pages but needs 4: alloc must be called first"):
        bm.build_tables([c])
    bm.alloc(c)
    assert bm.get_req_blocks("r") == [0, 1, 2, 3] and lengths(bm, c) == (1, 7)
    assert bm.metrics.cache_hit_rate == 0.0
    bm.check_integrity()


def test_lookup_table_padding_and_null_rows() -> None:
    bm = manager(num_blocks=16, page=4)
    real = ctx("real", range(9))  # 3 pages
    bm.claim("real")
    bm.alloc(real)
    bm.claim("pad", dummy=True)
    pad = ctx("pad", [0])
    t = bm.build_tables([real, pad])
    assert t.lookup_table.dtype == np.int32 and t.lookup_table.shape == (2, 8 + 16)
    assert t.lookup_table[0, :3].tolist() == [0, 1, 2]
    assert (t.lookup_table[0, 3:] == 16).all() and (t.lookup_table[1] == 16).all()
    assert t.cache_lengths.tolist() == [0, 0]
    assert bm.get_req_blocks("pad") == [16] and bm.pool.num_free == 13
    wide = bm.build_tables([real], max_cache_length=100)  # 25 pages -> 32 + 16 columns
    assert wide.lookup_table.shape == (1, 48)
    with pytest.raises(ValueError, match="max_cache_length=8 is below the batch's 3 pages of 4"):
        bm.build_tables([real], max_cache_length=8)
    with pytest.raises(ValueError, match="request 'real' is repeated in the batch"):
        bm.build_tables([real, real])
    with pytest.raises(ValueError, match="request 'ghost' is not claimed"):
        bm.build_tables([ctx("ghost", [1])])
    assert bm.build_tables([]).lookup_table.shape == (0, 16)
    with pytest.raises(ValueError, match="is a dummy"):
        bm.alloc(pad)
    bm.check_integrity()


@pytest.mark.parametrize("cols_for,expected", [(1, 24), (8, 24), (9, 32), (128, 144)])
def test_lookup_table_width(cols_for: int, expected: int) -> None:
    bm = manager(num_blocks=200, page=1)
    c = ctx("r", range(cols_for))
    bm.claim("r")
    bm.alloc(c)
    assert bm.build_tables([c]).lookup_table.shape == (1, expected)


def test_release_frees_tail_first_and_keeps_hashes() -> None:
    bm = manager(num_blocks=8, page=2)
    c = ctx("r", range(7))  # pages 0 1 2 3; full pages of tokens[:6]: 0 1 2
    bm.claim("r")
    bm.alloc(c)
    c.update(1)
    bm.step(c)
    assert bm.pool.num_cached == 3
    bm.release("r")
    # the uncommitted page 3 is fresh (reused first); cached pages evict tail first: 2, 1, 0
    assert bm.pool.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.pool.num_cached == 3 and bm.pool.num_used == 0
    with pytest.raises(ValueError, match="Attempted to release request ID 'r' but it is not claimed"):
        bm.release("r")
    bm.check_integrity()


def test_eviction_order_under_pressure() -> None:
    bm = manager(num_blocks=6, page=2)
    for rid, base in (("a", 0), ("b", 100)):
        c = ctx(rid, range(base, base + 5))  # 3 pages, 2 cached
        bm.claim(rid)
        bm.alloc(c)
        c.update(1)
        bm.step(c)
        bm.release(rid)
    # each request left its uncommitted last page fresh and two cached pages, freed tail first
    assert bm.pool.free_order() == [4, 5, 1, 0, 3, 2]
    c = ctx("c", range(200, 209))  # needs 5 pages: 2 fresh, then the 3 least recently freed cached
    bm.claim("c")
    bm.alloc(c)
    assert bm.get_req_blocks("c") == [4, 5, 1, 0, 3] and bm.metrics.evictions == 3
    assert bm.pool.lookup(drive_keys(bm, range(100, 105)), 0, 2) == [2]  # b's head page survives
    bm.check_integrity()


def drive_keys(bm: BlockManager, tokens: range) -> list:
    return hash_tokens(list(tokens), bm.page_size, seed=bm.hasher.seed or bytes(32))  # (a bare BlockManager: zeros)


def test_chunked_prefill_does_not_reuse_a_diverging_page() -> None:
    bm = manager(num_blocks=32, page=3)
    shared = list(range(10, 18))  # 8 tokens: pages [10..12] [13..15] [16,17,x]
    a = ctx("a", [*shared, 1, 2, 3])
    b = ctx("b", [*shared, 7, 8, 9])
    for c in (a, b):
        bm.claim(c.request_id)
    bm.alloc(a)
    a.tokens.chunk(6)
    a.update(0)
    bm.step(a)
    bm.alloc(a)
    a.update(0)
    bm.step(a)  # a done: pages for [10..12] [13..15] [16,17,1] committed
    bm.alloc(b)
    assert bm.get_req_blocks("b")[:2] == bm.get_req_blocks("a")[:2]
    assert bm.get_req_blocks("b")[2] != bm.get_req_blocks("a")[2]
    assert b.tokens.processed_length == 6 and bm.metrics.cache_tokens == 6
    bm.check_integrity()


def test_chunk_before_alloc_limits_the_skip() -> None:
    bm = manager(num_blocks=32, page=2)
    first = ctx("a", range(12))
    bm.claim("a")
    drive(bm, first, [0])
    c = ctx("b", range(12))
    c.tokens.chunk(5)  # active window 0..5: at most pages [0,1] may be skipped (4 tokens), 1 stays active
    bm.claim("b")
    bm.alloc(c)
    assert (c.tokens.processed_length, c.tokens.active_length) == (4, 1)
    bm.check_integrity()


def test_speculative_tokens_reserve_pages() -> None:
    plain = manager(num_blocks=16, page=4)
    spec = manager(num_blocks=16, page=4, num_speculative_tokens=4)
    for bm in (plain, spec):
        bm.claim("r")
        bm.alloc(ctx("r", range(3)))
    assert len(plain.get_req_blocks("r")) == 1 and len(spec.get_req_blocks("r")) == 2


def test_failed_alloc_leaves_no_trace() -> None:
    bm = manager(num_blocks=10, page=2)
    a = ctx("a", range(9))
    bm.claim("a")
    drive(bm, a, [1])
    bm.release("a")  # pages 0-3 cached-free (tokens 0..7), 4-9 fresh
    bm.claim("hog")
    bm.alloc(ctx("hog", range(100, 103)))  # takes fresh pages 4, 5
    b = ctx("b", [*range(8), *range(50, 60)])  # 9 pages: 4 hits, 5 new; only 4 free besides the hits
    bm.claim("b")
    before = snapshot(bm, b)
    with pytest.raises(InsufficientBlocksError) as info:
        bm.alloc(b)
    assert "Cannot get 5 free blocks for request 'b' (only 4 available; 2/10 blocks currently in use)" in str(
        info.value
    )
    assert (info.value.needed, info.value.available) == (5, 4)
    assert snapshot(bm, b) == before
    too_long = ctx("c", range(21))
    bm.claim("c")
    before = snapshot(bm, too_long)
    with pytest.raises(InsufficientBlocksError, match="needs 21 token slots but the whole cache holds 20"):
        bm.alloc(too_long)
    assert snapshot(bm, too_long) == before
    bm.check_integrity()


def test_misuse_errors() -> None:
    bm = manager(num_blocks=8, page=2)
    with pytest.raises(ValueError, match="request 'x' is not claimed: call claim\\(\\) first"):
        bm.alloc(ctx("x", [1]))
    with pytest.raises(ValueError, match="request 'x' is not claimed"):
        bm.step(ctx("x", [1]))
    bm.claim("x")
    with pytest.raises(ValueError, match="Request ID 'x' is already claimed"):
        bm.claim("x")
    stale = ctx("x", range(6))
    stale.tokens.skip_processing(4)  # pretends 4 tokens are cached that are not
    before = snapshot(bm, stale)
    with pytest.raises(ValueError, match="processed_length=4 but the cache holds 0 of its tokens"):
        bm.alloc(stale)
    assert snapshot(bm, stale) == before


def test_prefix_caching_off() -> None:
    bm = manager(num_blocks=8, page=2, caching=False)
    for rid in ("a", "b"):
        c = ctx(rid, range(5))
        bm.claim(rid)
        drive(bm, c, [1, 2])
    assert bm.get_req_blocks("a") == [0, 1, 2] and bm.get_req_blocks("b") == [3, 4, 5]
    assert bm.pool.num_cached == 0 and bm.metrics.cache_tokens == 0
    bm.release("a")
    assert bm.pool.free_order() == [0, 1, 2, 6, 7]


def test_repeating_prompt_hit_rate() -> None:
    bm = manager(num_blocks=16, page=1)
    for i in range(100):
        c = ctx(i, range(10, 15))
        bm.claim(i)
        bm.alloc(c)
        assert len(bm.get_req_blocks(i)) == 5
        c.update(3)
        bm.step(c)
        bm.release(i)
        bm.check_integrity()
    m = bm.metrics
    assert m.cache_tokens == 99 * 4 and m.input_tokens == 5 + 99 * 1
    assert bm.pool.num_used == 0 and bm.pool.num_cached == 5


def test_no_release_eventually_runs_out() -> None:
    bm = manager(num_blocks=64, page=4)
    rng = np.random.default_rng(0)
    admitted = 0
    with pytest.raises(InsufficientBlocksError):
        for i in range(100):
            c = ctx(i, rng.integers(0, 50, 16))
            bm.claim(i)
            bm.alloc(c)
            admitted += 1
    assert admitted == 16 and bm.pool.num_free == 0
    bm.check_integrity()


def test_reset_prefix_cache_and_metrics() -> None:
    bm = manager(num_blocks=16, page=1)
    for i in range(3):
        if i == 2:
            assert bm.reset_prefix_cache() == 5  # tokens 0..4 (the sampled 9 is never hashed)
        c = ctx(i, range(5))
        bm.claim(i)
        drive(bm, c, [9])
        bm.release(i)
    assert bm.metrics.cache_tokens == 4  # only the second request hit
    bm.reset_metrics()
    m = bm.metrics
    assert (m.input_tokens, m.cache_tokens, m.evictions) == (0, 0, 0) and m.total_pages == 16


def test_pages_needed_counts_evictable_hits() -> None:
    bm = manager(num_blocks=16, page=2)
    a = ctx("a", range(9))
    bm.claim("a")
    drive(bm, a, [1])
    bm.release("a")
    b = ctx("b", range(9))
    bm.claim("b")
    before = snapshot(bm, b)
    assert bm.pages_needed(b) == (1, 4)  # 4 cached-free hits leave the free list, 1 new page
    assert snapshot(bm, b) == before


def test_salts_never_share_pages() -> None:
    bm = manager(num_blocks=32, page=2)
    a = ctx("a", range(9), cache_salt="tenant-a")
    bm.claim("a")
    drive(bm, a, [1])
    b = ctx("b", range(9), cache_salt="tenant-b")
    bm.claim("b")
    bm.alloc(b)
    assert b.tokens.processed_length == 0 and not set(bm.get_req_blocks("a")) & set(bm.get_req_blocks("b"))


@pytest.mark.parametrize("algo", ["sha256", "sha256_64", "xxh3_128"])
def test_every_hash_algo_hits(algo: str) -> None:
    bm = manager(num_blocks=32, page=2, hash_algo=algo, hash_seed=b"\x05" * 32)
    drive_pair = [ctx(r, range(9)) for r in ("a", "b")]
    bm.claim("a")
    drive(bm, drive_pair[0], [1])
    bm.claim("b")
    bm.alloc(drive_pair[1])
    assert drive_pair[1].tokens.processed_length == 8
    bm.check_integrity()
