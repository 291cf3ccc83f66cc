"""State groups in the coordinator: one live state slot (plus draft slots) per request, beside attention pages."""

from __future__ import annotations

import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError, MissingPagesError
from pagedkv.core.managers import FullAttentionManager, MambaManager, SlidingWindowManager, min_request_pages
from pagedkv.core.tables import lut_columns

N = 12  # pool pages; the null page id is 12
N30 = 30  # the null page id of a 30-page pool


def coordinator(*groups, num_blocks: int = N, caching: bool = True, spec: int = 0) -> KVCacheCoordinator:
    return KVCacheCoordinator(num_blocks, 4, list(groups), enable_prefix_caching=caching, num_speculative_tokens=spec)


def test_a_request_holds_one_slot_per_state_group_whatever_its_length() -> None:
    c = coordinator(MambaManager(0, 4), MambaManager(1, 4), FullAttentionManager(2, 4))
    a = ctx("a", range(10))
    c.claim("a")
    c.alloc(a)  # 10 tokens: 3 attention pages, one slot in each state group
    assert [c.get_req_blocks("a", g) for g in range(3)] == [[0], [1], [2, 3, 4]]
    for token in range(100, 108):  # 8 decode steps: attention grows by 2 pages, the slots stay
        a.update(token)
        c.step(a)
        c.alloc(a)
        c.check_integrity()
    assert c.get_req_blocks("a", 0) == [0] and c.get_req_blocks("a", 1) == [1]
    assert c.get_req_blocks("a", 2) == [2, 3, 4, 5, 6]
    tables = c.build_group_tables([a])
    assert tables[0].lookup_table[0, 0] == 0 and tables[1].lookup_table[0, 0] == 1
    assert tables[0].cache_lengths.tolist() == [17]  # the state covers every processed token
    c.release("a")
    assert c.pool.num_used == 0
    c.check_integrity()


def test_draft_slots_come_with_the_live_slot() -> None:
    c = coordinator(MambaManager(0, 4, slots=3), FullAttentionManager(1, 4), spec=2)
    a = ctx("a", range(5))
    c.claim("a")
    c.alloc(a)
    assert c.get_req_blocks("a", 0) == [0, 1, 2]  # live slot + 2 draft slots
    assert c.build_group_tables([a])[0].lookup_table[0, :3].tolist() == [0, 1, 2]
    c.check_integrity()


def test_alloc_is_atomic_when_the_slot_does_not_fit() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4), num_blocks=4)
    a, b = ctx("a", range(8)), ctx("b", range(4))
    c.claim("a")
    c.alloc(a)  # slot + 2 pages: 3 of 4
    c.claim("b")
    before = snapshot(c)
    with pytest.raises(InsufficientBlocksError) as err:
        c.alloc(b)  # slot + 1 page: 2, only 1 free
    assert err.value.needed == 2 and err.value.available == 1
    assert snapshot(c) == before and c.get_req_blocks("b", 0) == [] and c.get_req_blocks("b", 1) == []
    c.check_integrity()


def test_a_pure_state_model_runs_any_length_in_one_slot() -> None:
    c = coordinator(MambaManager(0, 4), num_blocks=2)
    a = ctx("a", range(300))  # 300 tokens would need 75 attention pages; a state slot holds them all
    c.claim("a")
    c.alloc(a)
    assert c.get_req_blocks("a", 0) == [0] and c.pool.num_used == 1
    a.update(7)
    c.step(a)
    c.alloc(a)  # decode: nothing new
    assert c.pool.num_used == 1
    c.check_integrity()


def test_state_models_never_hit_a_cached_prefix() -> None:
    """A slot is updated in place: a cached attention prefix has no state to resume from, so no hit."""
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4))
    a = ctx("a", range(9))
    c.claim("a")
    c.alloc(a)
    a.update(1)
    c.step(a)
    c.release("a")
    b = ctx("b", range(9))
    c.claim("b")
    c.alloc(b)
    assert b.tokens.processed_length == 0 and c.metrics.cache_hit_rate == 0
    assert c.pool.num_cached == 0
    c.check_integrity()


def test_a_released_request_has_no_slot() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4))
    a = ctx("a", range(4))
    c.claim("a")
    with pytest.raises(MissingPagesError, match="holds 0 pages but needs 1"):
        c.build_group_tables([a])  # claimed but not allocated: no slot yet
    c.alloc(a)
    c.release("a")
    with pytest.raises(ValueError, match="not claimed|claimed"):
        c.build_group_tables([a])


def test_min_request_pages_counts_the_slots() -> None:
    full, window = FullAttentionManager(1, 4), SlidingWindowManager(2, 4, 4)
    state = MambaManager(0, 4, slots=2)
    assert min_request_pages([state, full], 10, 3) == 2 + 3  # 12 tokens: 3 pages, plus the slots
    # a window holds few pages (2 slots + 2 window pages at most), but the pool must still hold 40 token slots
    assert min_request_pages([state, window], 40, 1) == 10 == min_request_pages([window], 40, 1)
    assert min_request_pages([state], 1000, 1000) == 2


def test_integrity_catches_a_request_with_a_missing_slot() -> None:
    c = coordinator(MambaManager(0, 4, slots=2), FullAttentionManager(1, 4))
    a = ctx("a", range(4))
    c.claim("a")
    c.alloc(a)
    st = c._reqs["a"]
    page = int(st.tables[0].pages[1])
    st.tables[0].pages[1] = c.pool.null_block  # corrupt: a draft slot lost
    with pytest.raises(Exception, match="null|slots"):
        c.check_integrity()
    st.tables[0].pages[1] = page
    c.check_integrity()


@pytest.mark.parametrize("with_state", [True, False])
def test_swap_snapshot_and_restore_rebuild_every_group(with_state: bool) -> None:
    """Swap preemption's bookkeeping: the snapshot lists every held page (state slots included), restore
    rebuilds each table entry for entry (dropped window entries stay null) from fresh pages, and recommit
    puts the committed prefix back in the cache (with no state group: state models do not cache)."""
    first = MambaManager(0, 4) if with_state else FullAttentionManager(0, 4)
    c = coordinator(first, SlidingWindowManager(1, 4, 6), FullAttentionManager(2, 4), num_blocks=30)
    a = ctx("a", range(14))
    c.claim("a")
    c.alloc(a)
    for token in range(100, 104):
        a.update(token)
        c.step(a)
        c.alloc(a)
    c.check_integrity()
    before = [c.get_req_blocks("a", g) for g in range(3)]
    assert before[1][:3] == [N30] * 3 and N30 not in before[1][3:]  # the window dropped three pages
    pages, record = c.swap_snapshot("a")
    assert pages == [p for table in before for p in table if p != N30] and record.num_pages == len(pages)
    assert record.committed == (0 if with_state else 4)  # 17 processed tokens: 4 full pages
    c.release("a")
    other = ctx("b", range(3))
    c.claim("b")
    c.alloc(other)  # someone else takes pages meanwhile
    todo = c.swap_restore(a, record)
    assert [i for i, _ in todo] == list(range(len(pages)))
    after = [c.get_req_blocks("a", g) for g in range(3)]
    assert [[p == N30 for p in t] for t in after] == [[p == N30 for p in t] for t in before]
    assert len(set(p for _, p in todo)) == len(pages) and not set(p for _, p in todo) & set(c.get_req_blocks("b", 2))
    c.swap_recommit(a, record)
    c.check_integrity()
    assert c.metrics.used_pages == len(pages) + 3  # b: a page in each group
    if not with_state:
        assert c.pool.num_cached >= 4  # the committed prefix is cached again
    with pytest.raises(ValueError, match="is claimed"):
        c.swap_restore(a, record)
    a.update(7)
    c.step(a)
    c.alloc(a)  # the request resumes where it stopped
    c.check_integrity()


def test_swap_restore_is_atomic_when_the_pool_lacks_pages() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4), num_blocks=6)
    a = ctx("a", range(12))
    c.claim("a")
    c.alloc(a)  # a slot + 3 pages
    _, record = c.swap_snapshot("a")
    c.release("a")
    b = ctx("b", range(8))
    c.claim("b")
    c.alloc(b)  # a slot + 2 pages: 3 of 6 left
    before = snapshot(c)
    with pytest.raises(InsufficientBlocksError, match="to swap request 'a' back in") as err:
        c.swap_restore(a, record)
    assert (err.value.needed, err.value.available) == (4, 3)
    assert snapshot(c) == before and not c.contains("a")
    c.check_integrity()


def test_draft_slots_do_not_count_against_max_cache_length() -> None:
    c = coordinator(MambaManager(0, 4, slots=3), FullAttentionManager(1, 4), spec=2)
    a = ctx("a", range(5))
    c.claim("a")
    c.alloc(a)
    tables = c.build_group_tables([a], max_cache_length=8)  # 5 tokens + 2 drafts: 2 pages of 4
    assert tables[0].lookup_table[0, :3].tolist() == c.get_req_blocks("a", 0)
    assert tables[1].lookup_table.shape[1] == lut_columns(2)


def test_integrity_catches_pages_held_without_their_slots() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4))
    a = ctx("a", range(4))
    c.claim("a")
    c.alloc(a)
    st = c._reqs["a"]
    slot = st.tables[0].pages[:1].tolist()
    st.tables[0].num_pages = 0  # corrupt: the slot forgotten while the attention page is held
    with pytest.raises(Exception, match="holds pages but 0 of its 1 state slots"):
        c.check_integrity()
    st.tables[0].num_pages = 1
    assert st.tables[0].pages[:1].tolist() == slot
    c.check_integrity()
