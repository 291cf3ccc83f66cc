"""State groups in the coordinator: rows of a state pool (one live row plus draft rows per request, shared by
every state group), beside attention pages of their own pool."""

from __future__ import annotations

import pytest

from helpers import ctx, snapshot
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.errors import InsufficientBlocksError, MissingPagesError
from pagedkv.core.groups import FullAttentionManager, MambaManager, SlidingWindowManager, min_request_pages
from pagedkv.core.tables import lut_columns

N = 12  # attention pages; the null page id is 12
ROWS = 4  # state rows; the null row id is 4


def coordinator(
    *groups, num_blocks: int = N, caching: bool = True, spec: int = 0, rows: int = ROWS
) -> KVCacheCoordinator:
    return KVCacheCoordinator(num_blocks, 4, list(groups), enable_prefix_caching=caching, num_speculative_tokens=spec,
                              num_state_rows=rows)  # fmt: skip


def test_a_request_holds_one_row_for_every_state_group_whatever_its_length() -> None:
    c = coordinator(MambaManager(0, 4), MambaManager(1, 4), FullAttentionManager(2, 4))
    a = ctx("a", range(10))
    c.claim("a")
    c.alloc(a)  # 10 tokens: 3 attention pages; one state row, the same in both state groups
    assert [c.get_req_blocks("a", g) for g in range(3)] == [[0], [0], [0, 1, 2]]
    assert c.pool.num_used == 3 and c.states is not None and c.states.rows.num_used == 1
    for token in range(100, 108):  # 8 decode steps: attention grows by 2 pages, the row stays
        a.update(token)
        c.step(a)
        c.alloc(a)
        c.check_integrity()
    assert c.get_req_blocks("a", 0) == [0] == c.get_req_blocks("a", 1)
    assert c.get_req_blocks("a", 2) == [0, 1, 2, 3, 4]
    tables = c.build_group_tables([a])
    assert tables[0].lookup_table[0, 0] == 0 and tables[1].lookup_table[0, 1] == ROWS  # padded with the null row
    assert tables[2].lookup_table[0, 5] == N  # padded with the attention null page
    assert tables[0].cache_lengths.tolist() == [17]  # the state covers every processed token
    c.release("a")
    # the prompt's end (10 tokens) stays as a checkpoint holding the page of its tail (tokens 8, 9); none
    # at release: the last alloc sent the live state into a forward pass that never stepped
    assert len(c.states) == 1 and c.states.rows.num_used == 0
    assert c.pool.num_used == 1 and c.pool.ref_count(2) == 1
    c.check_integrity()


def test_draft_slots_come_with_the_live_slot() -> None:
    c = coordinator(MambaManager(0, 4, slots=3), FullAttentionManager(1, 4), spec=2)
    a = ctx("a", range(5))
    c.claim("a")
    c.alloc(a)
    assert c.get_req_blocks("a", 0) == [0, 1, 2]  # live row + 2 draft rows
    assert c.build_group_tables([a])[0].lookup_table[0, :3].tolist() == [0, 1, 2]
    c.check_integrity()


def test_alloc_is_atomic_when_no_state_row_is_free() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4), rows=1)
    a, b = ctx("a", range(8)), ctx("b", range(4))
    c.claim("a")
    c.alloc(a)  # the only row and 2 pages
    c.claim("b")
    before = snapshot(c)
    with pytest.raises(InsufficientBlocksError, match="state rows for request 'b'") as err:
        c.alloc(b)
    assert err.value.needed == 1 and err.value.available == 0
    assert snapshot(c) == before and c.get_req_blocks("b", 0) == [] and c.get_req_blocks("b", 1) == []
    c.check_integrity()


def test_alloc_is_atomic_when_the_pages_do_not_fit_but_a_row_does() -> None:
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4), num_blocks=3)
    a, b = ctx("a", range(8)), ctx("b", range(8))
    c.claim("a")
    c.alloc(a)  # 2 of 3 pages
    c.claim("b")
    before = snapshot(c)
    with pytest.raises(InsufficientBlocksError) as err:
        c.alloc(b)
    assert (err.value.needed, err.value.available) == (2, 1)
    assert snapshot(c) == before and c.states is not None and c.states.rows.num_used == 1
    c.check_integrity()


def test_state_row_count_is_checked() -> None:
    with pytest.raises(ValueError, match="num_state_rows=0 must be an int >= 2"):
        coordinator(MambaManager(0, 4, slots=2), rows=0)
    with pytest.raises(ValueError, match="same slots per request, got \\[1, 2\\]"):
        coordinator(MambaManager(0, 4), MambaManager(1, 4, slots=2))


def test_a_pure_state_model_runs_any_length_in_one_row() -> None:
    c = coordinator(MambaManager(0, 4), num_blocks=2)
    a = ctx("a", range(300))  # 300 tokens would need 75 attention pages; a state row holds them all
    c.claim("a")
    c.alloc(a)
    assert c.get_req_blocks("a", 0) == [0] and c.pool.num_used == 0
    a.update(7)
    c.step(a)
    c.alloc(a)  # decode: nothing new
    assert c.pool.num_used == 0 and c.states is not None and c.states.rows.num_used == 1
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


def test_min_request_pages_counts_no_attention_page_for_state_groups() -> None:
    full, window = FullAttentionManager(1, 4), SlidingWindowManager(2, 4, 4)
    state = MambaManager(0, 4, slots=2)
    assert min_request_pages([state, full], 10, 3) == 3 == min_request_pages([full], 10, 3)  # 12 tokens: 3 pages
    # a window holds few pages, but the pool must still hold 40 token slots
    assert min_request_pages([state, window], 40, 1) == 10 == min_request_pages([window], 40, 1)
    assert min_request_pages([state], 1000, 1000) == 0  # (its rows come from the state pool)


def test_integrity_catches_a_request_with_a_missing_slot() -> None:
    c = coordinator(MambaManager(0, 4, slots=2), FullAttentionManager(1, 4))
    a = ctx("a", range(4))
    c.claim("a")
    c.alloc(a)
    st = c._reqs["a"]
    page = int(st.tables[0].pages[1])
    st.tables[0].pages[1] = ROWS  # corrupt: a draft row lost (the null row in its place)
    with pytest.raises(Exception, match="name pages outside"):
        c.check_integrity()
    st.tables[0].pages[1] = page
    c.check_integrity()


def test_swap_bookkeeping_refuses_state_models() -> None:
    """A state model is preempted by release: its live row becomes a checkpoint its readmission resumes from."""
    c = coordinator(MambaManager(0, 4), FullAttentionManager(1, 4))
    a = ctx("a", range(6))
    c.claim("a")
    c.alloc(a)
    before = snapshot(c)
    with pytest.raises(ValueError, match="not swapped; preempt it by release"):
        c.swap_snapshot("a")
    assert snapshot(c) == before


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
