"""State checkpoints: prefix hits on models with recurrent state (where they are saved, what a hit
restores, eviction, failures that leave no trace)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import FullAttentionManager, MambaManager, SlidingWindowManager
from pagedkv.core.partial_pages import PageCopy
from pagedkv.core.state.checkpoints import StateCopy, checkpoint_key

PS = 4
SYSTEM = list(range(1000, 1010))  # 10 tokens: two full pages and a tail of 2


def coordinator(*, rows: int = 6, pages: int = 40, window: bool = False, caching: bool = True) -> KVCacheCoordinator:
    groups = [FullAttentionManager(0, PS), MambaManager(1, PS)]
    if window:
        groups.insert(1, SlidingWindowManager(1, PS, 6))
        groups[2] = MambaManager(2, PS)
    return KVCacheCoordinator(pages, PS, groups, enable_prefix_caching=caching, num_state_rows=rows)


def prefill(c: KVCacheCoordinator, rid: str, tokens: list[int], *, chunk: int | None = None, salt: str | None = None):
    """Claim and run the prompt (in chunks of `chunk`, each ending at a checkpoint cut when one is due: a
    divergence point, the position before the prompt's last token), then sample one token; returns the context."""
    a = ctx(rid, tokens, cache_salt=salt)
    c.claim(rid)
    while True:
        c.alloc(a)
        cut = c.checkpoint_cut(rid)
        n = a.tokens.active_length if chunk is None else min(chunk, a.tokens.active_length)
        if cut is not None and a.tokens.processed_length < cut < a.tokens.processed_length + n:
            n = cut - a.tokens.processed_length
        if n < a.tokens.active_length:
            a.tokens.chunk(n)
            a.update(0)  # (a chunk samples nothing)
        else:
            a.update(7)
        c.step(a)
        c.check_integrity()
        if a.tokens.generated_length:
            return a


def test_a_prompt_end_checkpoint_serves_the_next_turn_mid_page() -> None:
    c = coordinator()
    prefill(c, "a", SYSTEM)  # checkpoint before its last token, at 9 = page 2, tail (1008,)
    assert c.take_state_copies() == ([StateCopy(0, 1)], [])  # live row 0 -> checkpoint row 1
    b = ctx("b", [*SYSTEM, 7, 50, 51])  # the next turn: a's prompt, its token, new text
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 9 == b.cached_prefix_length
    assert c.get_req_blocks("b", 0)[:2] == c.get_req_blocks("a", 0)[:2]  # the full pages are shared
    own = c.get_req_blocks("b", 0)[2]
    assert own != c.get_req_blocks("a", 0)[2]  # page 2 is its own: the tail's 2 slots are copied in
    live = c.get_req_blocks("b", 1)[0]
    assert c.take_state_copies() == ([StateCopy(1, live)], [PageCopy(c.get_req_blocks("a", 0)[2], own, 1)])
    assert c.states is not None and c.states.num_hits == 1
    c.check_integrity()


def test_release_after_a_completed_step_keeps_the_live_row_as_a_checkpoint() -> None:
    c = coordinator()
    a = prefill(c, "a", [1, 2, 3, 4, 5, 6])
    c.take_state_copies()
    for token in (8, 9):  # two decode steps: the state ends at 8 tokens
        c.alloc(a)
        a.update(token)
        c.step(a)
    row = c.get_req_blocks("a", 1)[0]
    c.release("a")
    assert c.take_state_copies() == ([], [])  # no copy: the row itself is the checkpoint
    assert c.states is not None and c.states.rows.block_hash(row) is not None
    b = ctx("b", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12])  # a's 8 processed tokens (7 and 8 sampled), then more
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 8  # page-aligned: no tail copy
    assert c.take_state_copies() == ([StateCopy(row, c.get_req_blocks("b", 1)[0])], [])
    c.check_integrity()


def test_a_divergence_point_is_a_cut_and_then_a_hit() -> None:
    """The second user of a system prompt finds its attention pages but no state there: it ends a chunk at
    the page where the prompts diverge, the state there is saved, and the third user resumes from it."""
    c = coordinator()
    prefill(c, "a", [*SYSTEM, 20, 21])
    b = ctx("b", [*SYSTEM, 30, 31, 32])
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0  # pages 0, 1 cached, but a's checkpoint sits at 11 only
    assert c.checkpoint_cut("b") == 8
    c.release("b")
    b = prefill(c, "b", [*SYSTEM, 30, 31, 32])  # chunks end at the cut
    assert c.checkpoint_cut("b") is None
    d = ctx("d", [*SYSTEM, 40, 41])
    c.claim("d")
    c.alloc(d)
    assert d.tokens.processed_length == 8 and c.checkpoint_cut("d") == 11  # (its own prompt end's cut)
    c.check_integrity()


def test_the_prompt_end_cut_comes_after_the_divergence_cut() -> None:
    """A prompt's end checkpoint sits before its last token (a hit must leave that token to compute): the cut
    there follows the divergence cut, and the same prompt sent again resumes there."""
    c = coordinator()
    prefill(c, "a", [*SYSTEM, 20, 21])  # its prompt end at 11
    b = ctx("b", [*SYSTEM, 30, 31, 32])
    c.claim("b")
    c.alloc(b)
    assert c.checkpoint_cut("b") == 8  # pages 0, 1 cached: their end first
    b.tokens.chunk(8)
    b.update(0)
    c.step(b)
    assert c.checkpoint_cut("b") == 12  # then before its last token
    c.alloc(b)
    b.tokens.chunk(4)
    b.update(0)
    c.step(b)
    assert c.checkpoint_cut("b") is None and c.states is not None and len(c.states) == 3  # a's 11, b's 8 and 12
    c.alloc(b)
    b.update(7)  # its last token, sampled
    c.step(b)
    again = ctx("again", [*SYSTEM, 30, 31, 32])
    c.claim("again")
    c.alloc(again)
    assert again.tokens.processed_length == 12 and again.tokens.active_length == 1
    assert c.checkpoint_cut("again") is None  # (its hit reaches its last token: nothing more to save)
    c.check_integrity()


def test_a_driver_that_ignores_the_cut_gets_the_checkpoint_at_the_prompts_end() -> None:
    c = coordinator()
    a = ctx("a", list(range(300, 310)))
    c.claim("a")
    c.alloc(a)
    assert c.checkpoint_cut("a") == 9
    a.update(7)  # the whole prompt in one step
    c.step(a)
    assert c.checkpoint_cut("a") is None and c.states is not None and len(c.states) == 1
    b = ctx("b", [*range(300, 310), 7, 5])
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 10  # a's prompt end
    c.check_integrity()


def test_the_longest_matching_tail_wins_and_the_last_token_is_never_a_hit() -> None:
    base = list(range(1000, 1013))
    c = coordinator(rows=10)
    prefill(c, "a", base[:10])  # checkpoint before its last token: at 9 (page 2, tail of 1)
    prefill(c, "b", base[:12])  # hits at 9, checkpoint at 11 (tail of 3)
    c.take_state_copies()
    d = ctx("d", [*base[:12], 99])
    c.claim("d")
    c.alloc(d)
    assert d.tokens.processed_length == 11
    e = ctx("e", base[:11])  # 11 of b's tokens: the last must be computed, so 9 is the best hit
    c.claim("e")
    c.alloc(e)
    assert e.tokens.processed_length == 9
    f = ctx("f", [*base[:10], 55])  # 1008 matches the 9-token checkpoint's tail, 55 differs from b's 1010
    c.claim("f")
    c.alloc(f)
    assert f.tokens.processed_length == 9
    c.check_integrity()


def test_salts_never_share_a_checkpoint() -> None:
    c = coordinator()
    prefill(c, "a", SYSTEM, salt="tenant-a")
    b = ctx("b", [*SYSTEM, 5], cache_salt="tenant-b")
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0
    d = ctx("d", [*SYSTEM, 5], cache_salt="tenant-a")
    c.claim("d")
    c.alloc(d)
    assert d.tokens.processed_length == 9


def test_checkpoints_are_evicted_lru_with_their_tail_pages() -> None:
    c = coordinator(rows=3)  # three rows: a live one and checkpoints
    for i, rid in enumerate("abc"):  # checkpoints at 4 (its prompt end: on a page boundary, no tail page) and at
        prefill(c, rid, [100 * (i + 1) + t for t in range(5)])  # 5 (its release, in place: a tail of 1 on page 1)
        c.release(rid)
        c.take_state_copies()
        c.check_integrity()
    assert c.states is not None and len(c.states) == 3 and c.states.rows.num_evictions == 3
    keys = {e.key for e in c.states._entries.values()}
    first = ctx("x", [100, 101, 102, 103, 104])
    assert (
        checkpoint_key(c.hasher.extend(first.tokens.all, 0, 1, c.hasher.root())[0][0], first.tokens.all[4:5])
        not in keys
    )  # the oldest went first (the demoted prompt ends before it)
    assert sorted(len(e.tail) for e in c.states._entries.values()) == [0, 1, 1]  # b's release, c's two
    assert c.pool.num_used == 2  # the survivors' tail pages; the evicted ones' were released
    c.check_integrity()


def test_a_step_that_never_happened_saves_nothing_and_drops_its_restore() -> None:
    c = coordinator()
    prefill(c, "a", SYSTEM)
    c.take_state_copies()
    b = ctx("b", [*SYSTEM, 1, 2])
    c.claim("b")
    c.alloc(b)  # restores a's checkpoint; the forward pass then fails
    assert c.states is not None and c.states.rows.num_used == 3  # a's and b's live rows + the held checkpoint
    saved = c.states.num_saved
    c.release("b")
    assert c.take_state_copies() == ([], [])  # the restore is gone, its row reference too
    assert c.states.num_saved == saved and c.states.rows.num_used == 1
    c.check_integrity()


def test_a_hit_whose_row_is_short_adopts_it_and_a_request_with_no_row_changes_nothing() -> None:
    c = coordinator(rows=2)
    prefill(c, "a", SYSTEM)
    c.take_state_copies()  # row 0: a's live state, row 1: its prompt-end checkpoint (at 9)
    b = ctx("b", [*SYSTEM, 1, 2])
    c.claim("b")
    c.alloc(b)  # holding row 1 would leave b no live row: b adopts it (the checkpoint ends, its state is b's)
    assert b.tokens.processed_length == 9 and c.get_req_blocks("b", 1) == [1]
    assert c.states is not None and len(c.states) == 0
    c.check_integrity()  # (the tail page stays held until its copy is taken)
    tail = c.get_req_blocks("a", 0)[2]
    assert c.take_state_copies() == ([], [PageCopy(tail, c.get_req_blocks("b", 0)[2], 1)])  # no row copy
    d = ctx("d", [*SYSTEM, 3])
    c.claim("d")
    before = snapshot(c, d)
    with pytest.raises(InsufficientBlocksError, match="state rows") as err:
        c.alloc(d)  # both rows hold running requests' states
    assert (err.value.needed, err.value.available) == (1, 0)
    assert snapshot(c, d) == before
    c.check_integrity()


def test_a_hit_whose_tail_page_is_short_computes_instead() -> None:
    """4 pages of 4. a's checkpoint at 10 holds its page 2; b (a's 10 tokens + 6) needs all 4 pages, which the
    hit's tail page would leave it one short of: b computes from the start, the checkpoint giving its page back."""
    c = coordinator(pages=4)
    prefill(c, "a", list(range(1, 11)))
    c.release("a")
    c.take_state_copies()
    b = ctx("b", [*range(1, 11), 7, 20, 21, 22, 23, 24])
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0 and c.pool.num_used == 4
    c.check_integrity()


def test_a_failed_alloc_evicts_no_checkpoint() -> None:
    """A checkpoint tail that is also one of the plan's hit pages frees nothing allocatable: the alloc
    that cannot fit anyway raises before any checkpoint is evicted."""
    c = coordinator(pages=12)
    a = prefill(c, "a", list(range(1, 11)))  # prompt end at 10: tail on page 2
    for token in (8, 9):
        c.alloc(a)
        a.update(token)
        c.step(a)  # page 2 fills (11, 12 processed) and is committed while the checkpoint holds it
    c.release("a")
    c.take_state_copies()
    d = ctx("d", list(range(500, 520)))
    c.claim("d")
    c.alloc(d)  # 5 pages held
    b = ctx("b", [*a.tokens.all[:12].tolist(), *range(600, 620)])
    c.claim("b")
    before = snapshot(c, b)
    with pytest.raises(InsufficientBlocksError):
        c.alloc(b)
    assert snapshot(c, b) == before
    c.check_integrity()


def test_a_weights_update_between_a_step_and_the_release_saves_nothing() -> None:
    """A request whose state was computed under weights v1 is released after the version became v2 (the
    engine's update_weights): its live row must not become a checkpoint a v2 request could hit."""
    c = coordinator(pages=16)
    c.hasher.set_version("v1")
    a = prefill(c, "a", list(range(1, 4)))  # state at 3, inside the first page: the key's parent is the root
    c.take_state_copies()
    c.hasher.set_version("v2")
    c.release("a")
    a.reset()
    c.claim("a")
    c.alloc(a)
    assert a.tokens.processed_length == 0  # no v1 state resumes under v2
    c.check_integrity()


def test_reclaim_takes_the_lowest_priority_checkpoint_first() -> None:
    from pagedkv.core.pool import BlockPool
    from pagedkv.core.state.checkpoints import StateCheckpoints

    pool = BlockPool(8, True)
    states = StateCheckpoints(4, 1, pool, 4, enabled=True)
    first, second = pool.allocate(2)
    states.save(0, (b"root",), np.array([1], dtype=np.int32), [first], shared=True)  # older but shared
    states.save(0, (b"root",), np.array([2], dtype=np.int32), [second])
    pool.free([first, second])  # only the checkpoints hold the tail pages now
    states.take()
    assert states.reclaim(1)
    assert [e.shared for e in states._entries.values()] == [True]  # the plain one went, not the older shared one


def test_reset_prefix_cache_drops_checkpoints_and_their_tails() -> None:
    c = coordinator()
    a = prefill(c, "a", SYSTEM)
    c.alloc(a)
    a.update(8)
    c.step(a)  # a decode step: the state is at 11 tokens
    c.release("a")  # checkpoints at 10 (the prompt's end, a copy) and 11 (the live row itself)
    c.take_state_copies()
    assert c.states is not None and len(c.states) == 2
    assert c.reset_prefix_cache() >= 2
    assert len(c.states) == 0 and c.pool.num_used == 0
    c.check_integrity()


def test_without_prefix_caching_nothing_is_saved() -> None:
    c = coordinator(caching=False)
    prefill(c, "a", SYSTEM)
    c.release("a")
    assert c.take_state_copies() == ([], []) and c.states is not None and len(c.states) == 0
    b = ctx("b", [*SYSTEM, 3])
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0
    c.check_integrity()


def test_a_preempted_prefill_resumes_from_its_own_checkpoint() -> None:
    c = coordinator()
    a = ctx("a", list(range(1, 15)))
    c.claim("a")
    c.alloc(a)
    a.tokens.chunk(6)
    a.update(0)
    c.step(a)  # 6 of 14 processed
    c.release("a")  # preempted: the state at 6 becomes a checkpoint (tail of 2)
    a.reset()
    c.claim("a")
    c.alloc(a)
    assert a.tokens.processed_length == 6
    c.check_integrity()


def test_window_groups_resume_with_their_window_and_the_tail() -> None:
    c = coordinator(window=True)
    prefill(c, "a", list(range(1, 17)))  # checkpoint before its last token: at 15 (page 3, tail of 3)
    c.take_state_copies()
    b = ctx("b", [*range(1, 17), 7, 99])
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 15
    window = c.get_req_blocks("b", 1)
    assert window[0] == c.pool.null_block and window[1] != c.pool.null_block  # keys from 10 on: pages 2, 3 + tail
    copies, pages = c.take_state_copies()
    assert len(copies) == 1 and [p.num_tokens for p in pages] == [3, 3]  # the tail in both attention groups
    c.check_integrity()


def test_a_shared_checkpoint_outlives_newer_unread_ones() -> None:
    """Three rows. The checkpoint at a divergence point (8, shared by a and b) has a higher retention priority:
    when c's live row and its prompt end need rows, b's demoted prompt-end checkpoint and its newer release
    checkpoint go, not the older shared one (plain LRU would take the shared one)."""
    c = coordinator(rows=3)
    prefill(c, "a", [*SYSTEM, 20, 21])  # prompt-end checkpoint at 11
    c.release("a")  # (in place: its state at 12)
    prefill(c, "b", [*SYSTEM, 30, 31, 32])  # cut at 8 (shared), then its prompt end at 12: a's two go
    c.release("b")  # (in place: its state at 13; its prompt end is demoted)
    c.take_state_copies()
    assert c.states is not None and sorted(e.shared for e in c.states._entries.values()) == [False, False, True]
    prefill(c, "c", list(range(500, 511)))  # its live row and its prompt end take b's two, the shared one stays
    c.take_state_copies()
    assert [e.shared for e in c.states._entries.values()] == [True, False]
    d = ctx("d", [*SYSTEM, 40])
    c.claim("d")
    c.alloc(d)
    assert d.tokens.processed_length == 8
    c.check_integrity()


def test_a_release_demotes_the_checkpoints_it_supersedes() -> None:
    """Two checkpoint rows. a's prompt end (9) is superseded by its release (11): when e hits the prompt-end
    checkpoint and a new prompt's end needs a row, the demoted one goes although it was used last."""
    c = coordinator(rows=3)
    a = prefill(c, "a", list(range(1, 11)))  # prompt end at 9
    c.alloc(a)
    a.update(8)
    c.step(a)
    c.release("a")  # its release checkpoint at 11 supersedes the one at 9
    c.take_state_copies()
    e = ctx("e", [*range(1, 11), 99, 5])  # tail (9,) matches the checkpoint at 9, not (9, 10, 7)
    c.claim("e")
    c.alloc(e)
    assert e.tokens.processed_length == 9
    c.release("e")  # (no step: nothing saved, the restore dropped)
    c.take_state_copies()
    prefill(c, "f", list(range(200, 207)))  # its prompt end evicts the demoted checkpoint, not the one at 11
    c.take_state_copies()
    g = ctx("g", [*range(1, 11), 7, 3])  # a's prompt, its sampled 7, more
    c.claim("g")
    c.alloc(g)
    assert g.tokens.processed_length == 11
    c.release("g")
    h = ctx("h", [*range(1, 11), 99, 5])
    c.claim("h")
    c.alloc(h)
    assert h.tokens.processed_length == 0 and c.checkpoint_cut("h") == 8  # the state at 9 is gone
    c.check_integrity()
