"""Partial-page reuse in a `KVCacheCoordinator` of several groups: a hit also copies the first m tokens of a
cached page k in every cacheable group (one `PageCopy` per group, from the page each group caches under the
same chained hash); when some group no longer caches it, there is no partial hit."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core.context import TextContext
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.groups import FullAttentionManager, MambaManager, SlidingWindowManager
from pagedkv.core.partial_pages import PageCopy

PAGE = 4


def hybrid() -> KVCacheCoordinator:
    groups = [FullAttentionManager(0, PAGE), SlidingWindowManager(1, PAGE, window=8)]
    return KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, partial_page_reuse=True)


def served(c: KVCacheCoordinator, rid: str, tokens: list[int]) -> TextContext:
    """`rid` prefilled in one step (its full written pages committed)."""
    ctx = TextContext(rid, np.array(tokens))
    c.claim(rid)
    c.alloc(ctx)
    ctx.update(7)
    c.step(ctx)
    c.check_integrity()
    return ctx


A = list(range(100, 114))  # 14 tokens: pages 0..2 committed after its prefill
B = [*A[:9], 999, 998, 997]  # A's first 9 tokens: 2 full pages, then 1 token of A's page 2


def test_a_partial_hit_copies_the_page_in_every_group() -> None:
    c = hybrid()
    served(c, "a", A)
    source = [c.get_req_blocks("a", g)[2] for g in (0, 1)]
    b = TextContext("b", np.array(B))
    c.claim("b")
    c.alloc(b)
    c.check_integrity()  # (the pending copies hold their sources)
    assert b.cached_prefix_length == 9 and b.tokens.processed_length == 9
    dst = [c.get_req_blocks("b", g)[2] for g in (0, 1)]
    assert c.metrics.cache_tokens == 9
    assert c.take_page_copies() == [PageCopy(source[0], dst[0], 1), PageCopy(source[1], dst[1], 1)]
    assert c.take_page_copies() == []
    c.check_integrity()
    c.release("a")
    c.release("b")
    c.check_integrity()


@pytest.mark.parametrize("lacking", [None, 0, 1])
def test_free_sources_and_a_group_that_lacks_the_page(lacking: int | None) -> None:
    """After `a` is released its cached pages are free sources (held while the copy waits); when either
    group's page 2 has left the prefix cache, `b` hits its 2 full pages only."""
    c = hybrid()
    served(c, "a", A)
    source = [c.get_req_blocks("a", g)[2] for g in (0, 1)]
    c.release("a")
    if lacking is not None:
        c.pool.uncache([source[lacking]])
    b = TextContext("b", np.array(B))
    c.claim("b")
    c.alloc(b, 2)  # (a chunk of 2 tokens from the hit: the window group takes pages for them)
    c.check_integrity()
    copies = c.take_page_copies()
    if lacking is None:
        assert b.cached_prefix_length == 9
        assert copies == [PageCopy(source[g], c.get_req_blocks("b", g)[2], 1) for g in (0, 1)]
        assert all(c.pool.ref_count(p) == 0 for p in source)  # taken: the sources are free again
    else:
        assert b.cached_prefix_length == 8 and copies == []
    assert len(c.get_req_blocks("b", 1)) == 3  # the chunk [hit, hit + 2) lies in page 2
    c.release("b")
    c.check_integrity()


def test_release_drops_a_copy_never_taken() -> None:
    c = hybrid()
    served(c, "a", A)
    c.release("a")
    b = TextContext("b", np.array(B))
    c.claim("b")
    c.alloc(b)
    c.release("b")
    c.check_integrity()
    assert c.take_page_copies() == [] and c.pool.num_used == 0


def test_refusals() -> None:
    groups = [FullAttentionManager(0, PAGE), MambaManager(1, PAGE)]
    with pytest.raises(ValueError, match="partial_page_reuse=True does not support models with recurrent state"):
        KVCacheCoordinator(32, PAGE, groups, enable_prefix_caching=True, partial_page_reuse=True, num_state_rows=4)
    with pytest.raises(ValueError, match="partial_page_reuse=True needs enable_prefix_caching=True"):
        KVCacheCoordinator(32, PAGE, [FullAttentionManager(0, PAGE)], enable_prefix_caching=False,
                           partial_page_reuse=True)  # fmt: skip
    with pytest.raises(TypeError, match="partial_page_reuse=1 must be a bool"):
        KVCacheCoordinator(32, PAGE, [FullAttentionManager(0, PAGE)], enable_prefix_caching=True,
                           partial_page_reuse=1)  # type: ignore[arg-type]  # fmt: skip
    c = hybrid()
    with pytest.raises(ValueError, match="partial_page_reuse=True does not support tiers"):
        c.tier_link = object()  # type: ignore[assignment]
    assert c.tier_link is None
