"""Schedule-time caching (`commit_on_alloc`) on a model of several KV cache groups: a request admitted after
another in the same step hits the prefix the first is about to compute, in every group."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.context import TextContext
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.groups import FullAttentionManager, MambaManager, SlidingWindowManager

PAGE = 4


def coordinator(scheduled: bool) -> KVCacheCoordinator:
    groups = [FullAttentionManager(0, PAGE), SlidingWindowManager(1, PAGE, 8)]
    return KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, commit_on_alloc=scheduled)


def admit(c: KVCacheCoordinator, rid: str, tokens: list[int]) -> TextContext:
    ctx = TextContext(rid, np.array(tokens))
    c.claim(rid)
    c.alloc(ctx)
    c.check_integrity()
    return ctx


@pytest.mark.parametrize("scheduled", [True, False])
def test_a_request_admitted_in_the_same_step_hits_the_prefix_being_computed(scheduled: bool) -> None:
    c = coordinator(scheduled)
    prompt = list(range(1, 22))  # 21 tokens: 5 full pages, the last token's page is never committed
    a = admit(c, "a", prompt)
    b = admit(c, "b", [*prompt[:20], 99])  # same step: a's pages are not written yet
    assert b.cached_prefix_length == (20 if scheduled else 0)
    shared = set(c.get_req_blocks("a", 0)[:5]) & set(c.get_req_blocks("b", 0)[:5])
    assert len(shared) == (5 if scheduled else 0)
    if scheduled:  # the window group shares the pages its window reads at b's first query (positions 13..20)
        assert c.get_req_blocks("b", 1)[3:5] == c.get_req_blocks("a", 1)[3:5]
    for ctx in (a, b):
        ctx.update(7)
    c.step_batch([a, b])
    c.check_integrity()


def test_pages_committed_at_alloc_leave_the_cache_when_released_unwritten() -> None:
    c = coordinator(True)
    prompt = list(range(1, 22))
    admit(c, "a", prompt)
    cached = c.pool.num_cached
    assert cached == 10  # 5 pages in each group, hittable from now on
    c.release("a")  # before its step: its KV was never written
    c.check_integrity()
    assert c.pool.num_cached == 0
    assert admit(c, "b", prompt).cached_prefix_length == 0


def test_models_with_recurrent_state_refuse_it() -> None:
    groups = [FullAttentionManager(0, PAGE), MambaManager(1, PAGE)]
    with pytest.raises(ValueError, match="commit_on_alloc=True does not support models with recurrent state"):
        KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, commit_on_alloc=True, num_state_rows=4)


@pytest.mark.parametrize("scheduled", [True, False])
def test_a_window_groups_dropped_page_starts_a_new_chain_in_the_leaves_first_order(scheduled: bool) -> None:
    """Pages chain to the page before them for leaves-first eviction; a window group's page after a dropped
    (null) entry has no parent there, and commits past it keep the pool consistent (every chunk size)."""
    dropped = 0
    for window, chunk in [(w, k) for w in (4, 5, 8) for k in range(1, 10)]:
        groups = [FullAttentionManager(0, PAGE), SlidingWindowManager(1, PAGE, window)]
        c = KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, evict_leaves_first=True,
                               commit_on_alloc=scheduled)  # fmt: skip
        ctx = TextContext("a", np.arange(1, 30))
        c.claim("a")
        while ctx.tokens.active_length > 1:  # a chunked prefill: the window group drops pages behind it
            c.alloc(ctx, chunk)
            if ctx.tokens.active_length > chunk:
                ctx.tokens.chunk(chunk)
                ctx.tokens.advance_chunk()
            else:
                ctx.update(5)
            c.step(ctx)
            c.check_integrity()
        dropped += c.get_req_blocks("a", 1).count(c.pool.null_block)
        c.release("a")
        c.check_integrity()
    assert dropped > 0


@pytest.mark.parametrize("window_only", [False, True])
def test_an_alloc_again_before_the_forward_skips_nothing(window_only: bool) -> None:
    """Pages committed at alloc are not processed: a second alloc before the forward (a scheduler that allocs
    again) neither skips them nor hits them as its own prefix (it used to move ``processed`` past them)."""
    groups = [SlidingWindowManager(0, PAGE, 8)] if window_only else [FullAttentionManager(0, PAGE),
                                                                     SlidingWindowManager(1, PAGE, 8)]  # fmt: skip
    c = KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, commit_on_alloc=True)
    a = TextContext("a", np.arange(1, 18))
    c.claim("a")
    c.alloc(a, 4)  # one page's chunk: committed at alloc, unwritten
    a.tokens.chunk(4)
    tables = [c.get_req_blocks("a", g) for g in range(len(groups))]
    c.alloc(a, 4)
    assert a.tokens.processed_length == 0 and [c.get_req_blocks("a", g) for g in range(len(groups))] == tables
    c.check_integrity()
