"""`min_request_pages`: the smallest pool in which a lone request runs to its end, per group kind.

Checked against `KVCacheCoordinator` itself: a request stepping one token at a time (the
scheduler's smallest chunk) runs to its end in a pool of exactly that many pages, and fails in a
pool one page smaller (unless the floor of every slot fitting the pool binds); the same for a request preempted by recompute just before its last token
(its whole context is then a prompt, and full groups take every page at once).
"""

from __future__ import annotations

import pytest

from helpers import ctx
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    GroupManager,
    SinkAttentionManager,
    SlidingWindowManager,
    min_request_pages,
)


def serve_alone(groups: list[GroupManager], pages: int, ps: int, prompt: int, new: int, spec: int,
                caching: bool) -> bool:  # fmt: skip
    """True when a lone request of `prompt` tokens generates `new` tokens, one token per step."""
    c = KVCacheCoordinator(pages, ps, groups, enable_prefix_caching=caching, num_speculative_tokens=spec)
    a = (
        ctx("a", range(3, 3 + prompt), encoder_length=7)
        if any(g.reads_encoder for g in groups)
        else ctx("a", range(3, 3 + prompt))
    )
    c.claim("a")
    generated = 0
    while generated < new:
        try:
            c.alloc(a, num_scheduled_tokens=1)
        except InsufficientBlocksError:
            return False
        if a.tokens.active_length > 1:
            a.tokens.chunk(1)
        chunked = a.tokens.is_chunked
        a.update(100 + generated)
        generated += not chunked
        c.step(a)
        c.check_integrity()
    c.release("a")
    return True


KINDS = {
    "full": lambda ps: [FullAttentionManager(0, ps)],
    "sliding": lambda ps: [FullAttentionManager(0, ps), SlidingWindowManager(1, ps, 3)],
    "sliding-wide": lambda ps: [SlidingWindowManager(0, ps, 8), FullAttentionManager(1, ps)],
    "chunked": lambda ps: [FullAttentionManager(0, ps), ChunkedLocalAttentionManager(1, ps, 5)],
    "sinks": lambda ps: [SinkAttentionManager(0, ps, 6, 2), SlidingWindowManager(1, ps, 6)],
    "cross": lambda ps: [FullAttentionManager(0, ps), CrossAttentionManager(1, ps)],
    "windows-only": lambda ps: [SlidingWindowManager(0, ps, 4), ChunkedLocalAttentionManager(1, ps, 6)],
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("ps", [1, 3, 5])
@pytest.mark.parametrize("prompt,new", [(1, 1), (4, 9), (20, 10), (13, 2)])
@pytest.mark.parametrize("spec", [0, 2])
def test_min_request_pages_is_exact(kind: str, ps: int, prompt: int, new: int, spec: int) -> None:
    groups = KINDS[kind](ps)
    encoder = 7 if kind == "cross" else 0
    recomputed = prompt + new - 1  # preempted before its last token: everything is prompt
    for p, n in ((prompt, new), (recomputed, 1)):
        need = min_request_pages(groups, p, n, spec=spec, encoder_length=encoder)
        for caching in (False, True):
            assert serve_alone(KINDS[kind](ps), need, ps, p, n, spec, caching), (kind, p, n, need)
            # (with windows only, the cap on the context's slots may bind instead: the coordinator checks it
            # when it plans an alloc, which the decode fast path skips, so one page fewer can go unnoticed)
            cap = -(-(p + n - 1 + spec) // ps)
            if need > max(1, cap):
                assert not serve_alone(KINDS[kind](ps), need - 1, ps, p, n, spec, caching), (kind, p, n)


def test_min_request_pages_formulas() -> None:
    # full: every token and draft slot; 30 tokens of 5 -> 6 pages, +2 draft slots -> 7
    assert min_request_pages([FullAttentionManager(0, 5)], 20, 11) == 6
    assert min_request_pages([FullAttentionManager(0, 5)], 20, 11, spec=2) == 7
    # sliding W=3, pages of 5: a query at q needs [q-2, q]; at q = 5k+1 that spans pages k-1..k -> 2 pages;
    # at q = 5k + 4, the pages of q-2 and q+1 (the next query's slot is not taken: one token a step) -> 1..2
    assert SlidingWindowManager(0, 5, 3).step_pages(6, 7, 30) == 2
    assert SlidingWindowManager(0, 5, 3).step_pages(8, 9, 30) == 1
    assert min_request_pages([FullAttentionManager(0, 5), SlidingWindowManager(1, 5, 3)], 20, 11) == 8
    # the peak is joint: the chunk of [5, 10) spans 3 pages of 3 while the full group holds 4 of its 7
    chunked = [FullAttentionManager(0, 3), ChunkedLocalAttentionManager(1, 3, 5)]
    assert min_request_pages(chunked, 10, 10) == 9
    assert min_request_pages(chunked, 19, 1) == 10  # recomputed: every full page at once
    # chunked C=5, pages of 3: the chunk [5, 10) starts mid-page 1, so at q=9 pages 1..3 are held
    assert ChunkedLocalAttentionManager(0, 3, 5).step_pages(9, 10, 30) == 3
    # sinks keep their pages on top of the window
    assert SinkAttentionManager(0, 4, 4, 2).step_pages(20, 21, 30) == 1 + 2
    # cross-attention: the encoder's pages
    assert CrossAttentionManager(0, 4).step_pages(0, 1, 30, 0, encoder_length=9) == 3
    # windows repeat: a very long request costs no more than its full groups grow
    long_groups = [FullAttentionManager(0, 16), ChunkedLocalAttentionManager(1, 16, 8192)]
    assert min_request_pages(long_groups, 10**9, 1) == 10**9 // 16 + 8192 // 16  # a whole chunk at its last query
    # windows only (Mistral): still every slot of the context must fit the pool (the coordinator's cap)
    assert min_request_pages([SlidingWindowManager(0, 4, 4)], 30, 11) == 10
    with pytest.raises(ValueError, match="prompt_length=0"):
        min_request_pages([FullAttentionManager(0, 4)], 0, 1)
