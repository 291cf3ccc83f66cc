"""State checkpoints kept in runs of attention pages: one byte budget and one eviction policy for pages and
checkpoints (`StateCheckpoints` with ``run_pages``), torch-free."""

from __future__ import annotations

from helpers import ctx
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.events import BlockRemoved, BlockStored
from pagedkv.core.groups import FullAttentionManager, MambaManager
from pagedkv.core.partial_pages import PageCopy
from pagedkv.core.state.checkpoints import RunCopy, run_key

PS = 4
RUN = 3  # pages a checkpoint's run takes
SYSTEM = list(range(1000, 1010))  # 10 tokens: two full pages and a tail of 2


def coordinator(pages: int = 40, rows: int = 2, cap: int | None = None) -> KVCacheCoordinator:
    groups = [FullAttentionManager(0, PS), MambaManager(1, PS)]
    return KVCacheCoordinator(pages, PS, groups, enable_prefix_caching=True, num_state_rows=rows,
                              checkpoint_pages=RUN, max_state_checkpoints=cap)  # fmt: skip


def serve(c: KVCacheCoordinator, rid: str, tokens: list[int], release: bool = True) -> None:
    """Prefill `tokens` in one chunk (a checkpoint at the prompt's end), sample 7, one decode step (its state
    covers the prompt and 7), sample 8; then release (unless told not to: a checkpoint after 7)."""
    a = ctx(rid, tokens)
    c.claim(rid)
    for token in (7, 8):
        c.alloc(a)
        a.update(token)
        c.step(a)
        c.check_integrity()
    if release:
        c.release(rid)
        c.check_integrity()


def test_a_checkpoint_is_a_run_of_pages_cached_in_the_state_group_and_restores_mid_page() -> None:
    c = coordinator()
    states = c.states
    assert states is not None and states.run_pages == RUN and states.rows.num_blocks == 2
    serve(c, "a", SYSTEM, release=False)  # a holds pages 0-2; its prompt-end checkpoint (10) takes a run
    (entry,) = states._entries.values()
    assert entry.run == (3, 4, 5) and entry.row == states.run_base + 3 and len(entry.tail) == 2
    assert [c.pool.block_hash(p) for p in entry.run] == [run_key(entry.key, i) for i in range(RUN)]
    assert {c.pool.group_of(p) for p in entry.run} == {1} and c.pool.num_cached == 2 + RUN  # a's 2 full pages
    assert c.take_state_copies() == ([RunCopy(0, (3, 4, 5), True)], [])  # live row 0 -> the run
    b = ctx("b", [*SYSTEM, 50, 51])
    c.claim("b")
    c.alloc(b)
    assert b.cached_prefix_length == 10 and all(c.pool.ref_count(p) == 1 for p in entry.run)  # held by the restore
    own, live = c.get_req_blocks("b", 0)[2], c.get_req_blocks("b", 1)[0]
    assert c.take_state_copies() == ([RunCopy(live, (3, 4, 5), False)], [PageCopy(2, own, 2)])
    assert all(c.pool.ref_count(p) == 0 for p in entry.run)  # taken: the run is free and cached again
    c.check_integrity()


def test_evicting_one_page_of_a_run_drops_the_checkpoint_and_frees_the_whole_run() -> None:
    c = coordinator(pages=12)
    events: list[object] = []
    c.set_event_sink(events.append)
    serve(c, "a", SYSTEM)  # prompt-end run, then the release's run: 6 pages of checkpoints, 2 full pages cached
    states = c.states
    assert states is not None and len(states) == 2 and c.pool.num_cached == 2 + 2 * RUN
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.kv_cache_spec_kind for e in stored] == ["full_attention", "mamba", "mamba"]  # no event per run page
    events.clear()
    kept = {e.key for e in states._entries.values()}
    serve(c, "x", list(range(5000, 5033)), release=False)  # 9 pages: the 4 fresh ones, then 5 more
    # LRU: the prompt-end run goes first (one eviction frees its 3 pages), then the release's run; x's own
    # prompt-end run then takes a's 2 cached pages and the last free one
    assert not kept & {e.key for e in states._entries.values()} and len(states) == 1
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes[0] in kept, e.group_idx) for e in removed] == [(True, 1), (True, 1), (False, 0),
                                                                             (False, 0)]  # fmt: skip
    assert c.pool.num_evictions == 4  # a run is one eviction; its other pages become fresh
    c.check_integrity()


def test_a_cap_keeps_the_newest_checkpoints_and_a_save_never_evicts_what_the_queue_wants() -> None:
    c = coordinator(pages=40, cap=1)
    serve(c, "a", SYSTEM)  # the prompt-end run is replaced by the release's (cap 1)
    states = c.states
    assert states is not None and states.num_saved == 2 and len(states) == 1 and states.num_dropped == 1
    (entry,) = states._entries.values()
    assert len(entry.tail) == 3  # the release's checkpoint at 11 (the prompt and its token)
    tight = coordinator(pages=9)  # a (3 pages) + one run (3) + 3 free
    serve(tight, "a", SYSTEM, release=False)
    waiting = ctx("w", [*SYSTEM, 7, 1, 2, 3])
    tight.release("a")  # its release checkpoint takes a run: 3 free pages
    st = tight.states
    assert st is not None and sum(1 for e in st._entries.values() if e.run) == 2
    tight.expect([waiting])  # w wants a's pages and the run of its checkpoint at 11
    serve(tight, "y", list(range(9000, 9009)), release=False)  # 3 pages: the 2 fresh, then the unwanted run
    assert sum(1 for e in st._entries.values() if e.run) == 1  # the prompt-end run went, the wanted one stayed
    live = tight.get_req_blocks("y", 1)[0]
    tight.release("y")  # y's checkpoints find no unwanted room for a run: they stay in free state rows
    rows = [e.row for e in st._entries.values() if not e.run]
    assert rows == [1 - live, live]  # its prompt-end's copy in the other row, then its release in its own
    tight.claim("w")
    tight.alloc(waiting)
    assert waiting.cached_prefix_length == 11  # a's pages and its release checkpoint were kept for it
    tight.check_integrity()
