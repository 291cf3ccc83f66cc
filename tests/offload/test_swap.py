"""Swap preemption: a request's pages go to host rows and come back bit for bit; failures change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from test_host_tier import LAYOUTS, pages, scramble

from helpers import ctx, decode, make_params
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.testing import PrefixStampModel

LOCAL = dict(enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=1)


def manager(device_pages: int = 8, host_pages: int = 8) -> PagedKVCacheManager:
    params = make_params(**LOCAL, n_kv_heads=2, head_dim=2, num_layers=2)
    return PagedKVCacheManager(params, None, device_pages, total_num_host_pages=host_pages, max_batch_size=4,
                               enable_runtime_checks=True)  # fmt: skip


def snapshot(mgr: PagedKVCacheManager) -> tuple:
    bm = mgr._managers[0]
    return (bm.pool.free_order(), bm.pool.num_cached, {r: bm.get_req_blocks(r) for r in bm.request_ids()},
            mgr.tiers.swap_spaces[0].rows_available(), mgr.get_num_used_host_pages())  # fmt: skip


@pytest.mark.parametrize("layout", ["fp32", "bf16", "fp8-scales", "mha-tp2", "mla-tp2"])
def test_swapped_pages_come_back_bit_exact(layout: str) -> None:
    mgr = PagedKVCacheManager(LAYOUTS[layout](), None, 6, total_num_host_pages=8, max_batch_size=4)
    c = ctx("a", range(1, 23))  # 22 tokens, pages of 4: 6 pages, the last one partial
    mgr.claim("a")
    mgr.alloc(c)
    scramble(mgr, seed=1)
    before = pages(mgr, mgr.get_req_blocks("a"))
    assert mgr.swap_out("a") and mgr.is_swapped("a") and not mgr.contains("a")
    other = ctx("b", range(50, 74))  # takes every device page: the swapped pages are overwritten
    mgr.claim("b")
    mgr.alloc(other)
    scramble(mgr, seed=2)
    mgr.release("b")
    mgr.reset_prefix_cache()  # nothing on device or in the host index helps: the bytes must come from swap rows
    mgr.swap_in(c)
    assert pages(mgr, mgr.get_req_blocks("a")) == before
    assert c.tokens.processed_length == 0 and len(c.tokens) == 22  # the context was not touched
    mgr.release("a")
    mgr.check_integrity()
    assert mgr.tiers.swap_spaces[0].rows_available() == 8 and mgr.tiers.swap_spaces[0].rows_lent == 0


def test_resumed_request_reads_its_own_kv_and_reuses_cached_prefix_pages() -> None:
    mgr = manager()
    model = PrefixStampModel(mgr)
    a = ctx("a", range(1, 11))  # 10 tokens
    mgr.claim("a")
    decode(mgr, model, a, 2)  # 12 tokens, 11 written: pages 0-1 committed, page 2 partial
    table = mgr.get_req_blocks("a")
    assert mgr.swap_out("a")
    stats = mgr.tier_stats()["host"]
    assert stats["pages_swapped_out"] == 3 and mgr.tiers.swap_spaces[0].rows_lent == 3
    mgr.swap_in(a)  # pages 0-1 are still cached on device: reused, only page 2 is copied back
    assert mgr.get_req_blocks("a")[:2] == table[:2]
    assert mgr.tier_stats()["host"]["pages_swapped_in"] == 1 and mgr.tiers.swap_spaces[0].rows_lent == 0
    decode(mgr, model, a, 4, first=200)  # PrefixStampModel checks every position it reads
    assert model.positions_checked >= 10 + 11 + 12 + 13
    mgr.release("a")
    mgr.check_integrity()


def test_swap_out_without_room_and_swap_in_without_pages_change_nothing() -> None:
    mgr = manager(device_pages=6, host_pages=2)
    a = ctx("a", range(1, 14))  # 4 pages: more than the 2 host rows
    mgr.claim("a")
    mgr.alloc(a)
    state = snapshot(mgr)
    assert not mgr.swap_out("a")
    assert snapshot(mgr) == state and mgr.contains("a")
    mgr.release("a")
    small = ctx("s", range(1, 6))  # 2 pages
    mgr.claim("s")
    mgr.alloc(small)
    assert mgr.swap_out("s")
    big = ctx("big", range(30, 54))  # 6 pages: the whole pool
    mgr.claim("big")
    mgr.alloc(big)
    state = snapshot(mgr)
    with pytest.raises(InsufficientBlocksError, match="to swap request 's' back in"):
        mgr.swap_in(small)
    assert snapshot(mgr) == state and mgr.is_swapped("s")
    with pytest.raises(ValueError, match="request 'big' is not swapped out"):
        mgr.swap_in(big)
    mgr.release("s")  # a swapped request released: its rows go back
    assert not mgr.is_swapped("s") and mgr.tiers.swap_spaces[0].rows_available() == 2
    mgr.release("big")
    mgr.check_integrity()


def test_swap_needs_a_host_tier() -> None:
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), None, 4, max_batch_size=2)
    mgr.claim("a")
    mgr.alloc(ctx("a", range(1, 6)))
    assert not mgr.can_swap and not mgr.swap_out("a") and mgr.contains("a")


def test_lent_rows_survive_host_eviction_and_reset() -> None:
    mgr = manager(device_pages=8, host_pages=4)
    model = PrefixStampModel(mgr)
    a = ctx("a", range(1, 10))
    mgr.claim("a")
    decode(mgr, model, a, 1)
    assert mgr.swap_out("a")  # 3 rows lent, 1 left for offloads
    for i in range(3):  # other prompts commit pages: offloads must not take the lent rows
        c = ctx(f"o{i}", np.arange(40 + 10 * i, 49 + 10 * i))
        mgr.claim(c.request_id)
        decode(mgr, model, c, 1)
        mgr.release(c.request_id)
    mgr.sync_tiers()
    mgr.reset_prefix_cache()
    mgr.swap_in(a)
    decode(mgr, model, a, 2, first=300)  # still reads exactly its own KV
    mgr.release("a")
    mgr.check_integrity()
    mgr.tiers.connectors[0].host.index.check_integrity()
