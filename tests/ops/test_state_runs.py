"""`ops.state_runs`: a state row laid over a run of attention pages and back, fast path against reference."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops.state_runs import copy_state_run, copy_state_run_reference


def arenas(row_bytes: int, page_bytes: int = 48, pages: int = 10, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(row_bytes)
    page_arena = torch.randint(0, 256, (pages, page_bytes), generator=g, dtype=torch.uint8)  # [pages, P]
    state_arena = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)  # [rows, R]
    return page_arena, state_arena


@pytest.mark.parametrize("row_bytes", [48, 100, 144, 20])  # whole pages, a partial last page, one partial page
def test_save_and_restore_match_the_reference_and_round_trip(row_bytes: int) -> None:
    n = -(-row_bytes // 48)
    run = [7, 2, 9, 4][:n]
    fast_pages, fast_rows = arenas(row_bytes)
    ref_pages, ref_rows = fast_pages.clone(), fast_rows.clone()
    copy_state_run(fast_pages, fast_rows, 1, run, True)
    copy_state_run_reference(ref_pages, ref_rows, 1, run, True)
    assert torch.equal(fast_pages, ref_pages) and torch.equal(fast_rows, ref_rows)
    flat = torch.cat([fast_pages[p] for p in run])[:row_bytes]
    assert torch.equal(flat, fast_rows[1])  # the row's bytes, end to end over the run
    untouched = [p for p in range(10) if p not in run]
    assert torch.equal(fast_pages[untouched], arenas(row_bytes)[0][untouched])
    copy_state_run(fast_pages, fast_rows, 2, run, False)  # restore into another row
    copy_state_run_reference(ref_pages, ref_rows, 2, run, False)
    assert torch.equal(fast_rows, ref_rows) and torch.equal(fast_rows[2], fast_rows[1])
    assert torch.equal(fast_rows[0], arenas(row_bytes)[1][0])  # other rows untouched


def test_bad_runs_are_refused_before_anything_moves() -> None:
    pages, rows = arenas(100)
    before = pages.clone(), rows.clone()
    for run, row, match in [([1, 2], 0, "3 distinct pages"), ([1, 1, 2], 0, "distinct"), ([1, 2, 10], 0, "in \\[0, 10\\)"),
                            ([1, 2, 3], 3, "row 3 is outside")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            copy_state_run(pages, rows, row, run, True)
    with pytest.raises(ValueError, match="uint8"):
        copy_state_run(pages.float(), rows, 0, [1, 2, 3], True)
    assert torch.equal(pages, before[0]) and torch.equal(rows, before[1])
