"""`tier_hits.tier_hit` through a `KVCacheCoordinator`'s first alloc: which checkpoint the tiers below serve.

`DictTiers` is a `TierLink` over sets (pages by prefix hash, checkpoints by key): an in-memory tier, whose
loads record where their bytes would land. A model with recurrent state resumes from the tiers only at a
checkpoint they hold: the deepest one that lies past the device's hit, at or before the request's last token
(always computed, for its logits), with every attention page before it held; every position of the last
`RECENT_PAGES` pages the tiers reach is a candidate, and only page boundaries before them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from helpers import ctx
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.groups import FullAttentionManager, MambaManager
from pagedkv.core.hashing import BlockHash
from pagedkv.core.state.checkpoints import checkpoint_key
from pagedkv.core.tier_hits import RECENT_PAGES

PS = 4


class DictTiers:
    """A `TierLink` holding `pages` (prefix hashes: one page of each cacheable group) and `checkpoints` (keys).
    `pages_readable` pages at most load (a refused page ends a load); `images_readable` False refuses images."""

    def __init__(self, pages: Sequence[BlockHash] = (), checkpoints: Sequence[bytes] = ()) -> None:
        self.pages = set(pages)
        self.checkpoints = set(checkpoints)
        self.pages_readable = 1 << 30
        self.images_readable = True
        self.probes: list[list[bytes]] = []  # each `held_checkpoints` call's keys
        self.page_loads: list[tuple[list[list[int]], list[BlockHash]]] = []  # (device pages per group, hashes)
        self.image_loads: list[tuple[bytes, int, list[int], BlockHash | None]] = []  # (key, row, tails, parent)

    def held_pages(self, keys: Sequence[BlockHash]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))

    def load_pages(self, tables: Sequence[Sequence[int]], keys: Sequence[BlockHash]) -> int:
        got = min(self.held_pages(keys), self.pages_readable)
        self.page_loads.append(([list(t[:got]) for t in tables], list(keys[:got])))
        return got

    def held_checkpoints(self, keys: Sequence[bytes]) -> list[bool]:
        self.probes.append(list(keys))
        return [k in self.checkpoints for k in keys]

    def load_checkpoint(self, key: bytes, row: int, tail_pages: Sequence[int], parent: BlockHash | None) -> bool:
        self.image_loads.append((key, row, list(tail_pages), parent))
        return self.images_readable and key in self.checkpoints


def coordinator(link: DictTiers | None = None) -> KVCacheCoordinator:
    c = KVCacheCoordinator(64, PS, [FullAttentionManager(0, PS), MambaManager(1, PS)], enable_prefix_caching=True,
                           num_state_rows=6)  # fmt: skip
    c.tier_link = link
    return c


class Chain:
    """Prefix hashes and checkpoint keys of `tokens` under `c`'s hasher."""

    def __init__(self, c: KVCacheCoordinator, tokens: list[int]) -> None:
        self.tokens = np.asarray(tokens)
        self.root = c.hasher.root()
        self.hashes = c.hasher.extend(self.tokens, 0, len(tokens) // PS, self.root)[0]

    def checkpoint(self, pos: int) -> bytes:
        h = pos // PS
        return checkpoint_key(self.hashes[h - 1] if h else (self.root,), self.tokens[h * PS : pos].astype(np.int32))


def tokens(n: int, offset: int = 100) -> list[int]:
    return list(range(offset, offset + n))


def admit(c: KVCacheCoordinator, rid: str, toks: list[int]) -> int:
    """Claim and alloc; returns where the request resumes (its processed tokens). Checks integrity."""
    r = ctx(rid, toks)
    c.claim(rid)
    c.alloc(r)
    c.check_integrity()
    assert r.cached_prefix_length == r.tokens.processed_length
    return int(r.tokens.processed_length)


def test_the_deepest_held_checkpoint_wins_and_none_past_the_last_token_is_asked() -> None:
    """26 tokens: the last (25) is computed, so the candidates are 25 down to 1, asked in one batch, deepest
    first. Held: 9, 17, 22 and 26 (past the last token, never asked): 22 wins, pages 0-4 load into the
    request's own pages, the image into its live row with page 5 as its tail page."""
    link = DictTiers()
    c = coordinator(link)
    chain = Chain(c, tokens(26))
    link.pages.update(chain.hashes)
    link.checkpoints.update(chain.checkpoint(p) for p in (9, 17, 22, 26))
    assert admit(c, "r", tokens(26)) == 22
    assert link.probes == [[chain.checkpoint(p) for p in range(25, 0, -1)]]
    table, row = c.get_req_blocks("r", 0), c.get_req_blocks("r", 1)[0]
    assert link.page_loads == [([table[:5]], chain.hashes[:5])]
    assert link.image_loads == [(chain.checkpoint(22), row, [table[5]], chain.hashes[4])]
    assert [c.pool.cached_page(h, 0) for h in chain.hashes[:5]] == table[:5]  # committed as hits
    assert c.pool.cached_page(chain.hashes[5], 0) is None
    c.release("r")
    c.check_integrity()


def test_a_page_aligned_checkpoint_has_no_tail_page_and_one_in_the_first_page_no_parent() -> None:
    link = DictTiers()
    c = coordinator(link)
    chain = Chain(c, tokens(30))
    link.pages.update(chain.hashes)
    link.checkpoints.add(chain.checkpoint(16))
    assert admit(c, "r", tokens(30)) == 16
    assert link.image_loads == [(chain.checkpoint(16), c.get_req_blocks("r", 1)[0], [], chain.hashes[3])]
    link2 = DictTiers(checkpoints=[chain.checkpoint(3)])  # no page held: only the first page's positions
    c2 = coordinator(link2)
    assert admit(c2, "r", tokens(30)) == 3
    assert link2.page_loads == [] and link2.image_loads[0][2:] == ([c2.get_req_blocks("r", 0)[0]], None)
    assert link2.probes == [[chain.checkpoint(p) for p in (3, 2, 1)]]  # (reach 0: page 0's positions only)


def test_only_page_boundaries_are_asked_before_the_last_recent_pages() -> None:
    """51 tokens, 12 pages held (the reach): positions of pages 12..5 are all candidates, pages 4..1 only at
    their boundary. A checkpoint at 9 or 17 (mid-page, old) is never asked; the one at 8 is found."""
    assert RECENT_PAGES == 8
    link = DictTiers()
    c = coordinator(link)
    chain = Chain(c, tokens(51))
    link.pages.update(chain.hashes)
    link.checkpoints.update(chain.checkpoint(p) for p in (8, 9, 17))
    assert admit(c, "r", tokens(51)) == 8
    recent = [p for p in range(50, 19, -1)]  # pages 12 (positions 48..50) down to 5 (20..23)
    assert link.probes == [[chain.checkpoint(p) for p in [*recent, 16, 12, 8, 4]]]
    assert link.page_loads == [([c.get_req_blocks("r", 0)[:2]], chain.hashes[:2])]


def test_a_checkpoint_needs_every_page_before_it_held() -> None:
    """The tiers reach 3 pages: 22 (needs 5) is not a candidate; 13 (page 3's tail, carried by its image) is."""
    link = DictTiers()
    c = coordinator(link)
    chain = Chain(c, tokens(26))
    link.pages.update(chain.hashes[:3])
    link.checkpoints.update(chain.checkpoint(p) for p in (13, 22))
    assert admit(c, "r", tokens(26)) == 13
    assert link.probes == [[chain.checkpoint(p) for p in range(15, 0, -1)]]
    table = c.get_req_blocks("r", 0)
    assert link.image_loads == [(chain.checkpoint(13), c.get_req_blocks("r", 1)[0], [table[3]], chain.hashes[2])]


def test_none_before_the_device_hit() -> None:
    """The device resumes at 10 (a's prompt end, 2 pages and a tail of 2): a tier checkpoint at 9 is not asked
    and gives nothing; one at 13 is deeper: page 2 loads (after the device's 2), then the image at 13."""
    system = tokens(10)
    for held, want in (((9,), 10), ((9, 13), 13)):
        link = DictTiers()
        c = coordinator(link)
        prefill_and_release(c, "a", system)  # (the tiers hold nothing yet: a computes from 0)
        chain = Chain(c, [*system, 50, 51, 52, 53, 54, 55])
        link.pages.update(chain.hashes)
        link.checkpoints.update(chain.checkpoint(p) for p in held)
        link.probes.clear()
        link.page_loads.clear()
        link.image_loads.clear()
        assert admit(c, "b", [*system, 50, 51, 52, 53, 54, 55]) == want
        assert all(p > 10 for probe in link.probes for p in positions(chain, probe))
        table = c.get_req_blocks("b", 0)
        if want == 10:
            assert link.page_loads == [] and link.image_loads == []
        else:
            assert link.page_loads == [([table[2:3]], chain.hashes[2:3])]
            row = c.get_req_blocks("b", 1)[0]
            assert link.image_loads == [(chain.checkpoint(13), row, [table[3]], chain.hashes[2])]
        c.release("b")
        c.check_integrity()


def prefill_and_release(c: KVCacheCoordinator, rid: str, toks: list[int]) -> None:
    """Run `toks` as one prefill step (its prompt end is saved as a checkpoint) and release it."""
    r = ctx(rid, toks)
    c.claim(rid)
    c.alloc(r)
    r.update(7)
    c.step(r)
    c.take_state_copies()
    c.release(rid)
    c.check_integrity()


def positions(chain: Chain, keys: list[bytes]) -> list[int]:
    """The positions of `keys` among `chain`'s checkpoint keys."""
    index = {chain.checkpoint(p): p for p in range(1, len(chain.tokens) + 1)}
    return [index[k] for k in keys]


def test_a_failed_load_gives_no_hit_and_commits_nothing() -> None:
    """A page refused midway, or an image refused after every page loaded: the request computes from 0 and
    none of the pages the tiers were asked for is committed as a hit."""
    for pages_readable, images_readable in ((3, True), (1 << 30, False)):
        link = DictTiers()
        link.pages_readable, link.images_readable = pages_readable, images_readable
        c = coordinator(link)
        chain = Chain(c, tokens(26))
        link.pages.update(chain.hashes)
        link.checkpoints.add(chain.checkpoint(22))
        assert admit(c, "r", tokens(26)) == 0
        assert all(c.pool.cached_page(h, 0) is None for h in chain.hashes)
        assert len(link.image_loads) == (0 if pages_readable == 3 else 1)
        c.release("r")
        c.check_integrity()
        assert c.pool.num_free == c.pool.num_blocks
