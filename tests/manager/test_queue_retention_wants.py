from __future__ import annotations

import numpy as np

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext

PS = 4


def serve(bm, rid, toks):
    c = TextContext(rid, np.asarray(toks))
    bm.claim(rid)
    bm.alloc(c)
    c.update(7)
    bm.step(c)
    bm.release(rid)
    return c.cached_prefix_length


def cached(bm, toks):
    n = (len(toks) - 1) // PS
    keys, _ = bm.hasher.extend(np.asarray(toks), 0, n, bm.hasher.root(None))
    return len(bm.pool.lookup(keys, 0, n))


def test_wants_taken_before_a_weights_version_change_keep_dead_pages_over_live_ones():
    """LLMEngine.update_weights: a waiting request expected under v1 keeps v1's pages (never hittable
    again) ahead of v2's live pages, until it is admitted."""
    bm = BlockManager(7, PS, enable_prefix_caching=True)
    p = list(range(100, 109))
    serve(bm, "a", p)  # v1 pages of p
    waiting = TextContext("a2", np.asarray(p))
    bm.expect([waiting])  # keys under v1
    bm.hasher.set_version("v2")
    serve(bm, "b", p)  # v2 pages of the same prompt: what a2 will actually hit
    bm.expect([waiting])  # the scheduler tells it again each step: known, not re-keyed
    bm.claim("s")
    bm.alloc(TextContext("s", np.arange(300, 320)))  # 5 pages: 3 fresh + 2 evicted
    bm.release("s")
    assert serve(bm, "a2", p) == 2 * PS  # FAILS: the dead v1 pages were kept, a2's v2 pages evicted
