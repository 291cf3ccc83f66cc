"""Copy a state row into a run of attention pages and back (state checkpoints in the page budget).

A model with recurrent state and attention pages keeps each state checkpoint in a run of attention
pages (`core.state.checkpoints`, run mode). Per TP shard, the state arena is ``uint8 [rows, row_bytes]``
and the page arena ``uint8 [pages, page_bytes]`` (`runtime.arena`); a run of ``R`` pages holds one
row laid end to end::

    pages[run[i]][:] = row[i * page_bytes : (i + 1) * page_bytes]     # the last page partly filled

`copy_state_run_reference` copies page by page (the source of truth); `copy_state_run` does one
gather or scatter over the whole run. Both move bytes exactly (uint8 arenas).

This module sits at the manager's layer (it imports nothing from pagedkv): `PagedKVCacheManager`
runs a replica's pending `RunCopy`s with it, in order, with the other state copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_run", "copy_state_run", "copy_state_run_reference"]


def check_run(page_arena: torch.Tensor, state_arena: torch.Tensor, row: int, pages: Sequence[int]) -> None:
    """ValueError unless both arenas are 2-D uint8, `row` and `pages` are in range, the pages are distinct
    and hold a row (``len(pages) * page_bytes >= row_bytes``) with no page to spare."""
    if page_arena.dim() != 2 or state_arena.dim() != 2 or page_arena.dtype != torch.uint8:
        raise ValueError("arenas must be uint8 [pages, page_bytes] and [rows, row_bytes]")
    if state_arena.dtype != torch.uint8:
        raise ValueError("arenas must be uint8 [pages, page_bytes] and [rows, row_bytes]")
    n_pages, page_bytes = page_arena.shape
    rows, row_bytes = state_arena.shape
    need = -(-int(row_bytes) // int(page_bytes))
    if not 0 <= row < rows:
        raise ValueError(f"row {row} is outside the state arena's {rows} rows")
    if len(pages) != need or len(set(pages)) != len(pages) or not all(0 <= p < n_pages for p in pages):
        raise ValueError(f"a run of a {row_bytes}-byte row over {page_bytes}-byte pages is {need} distinct pages "
                         f"in [0, {n_pages}), got {list(pages)}")  # fmt: skip


def copy_state_run_reference(
    page_arena: torch.Tensor, state_arena: torch.Tensor, row: int, pages: Sequence[int], save: bool
) -> None:
    """`save`: pages of the run = state row `row`; else the row = the run (page by page)."""
    check_run(page_arena, state_arena, row, pages)
    page_bytes, row_bytes = page_arena.shape[1], state_arena.shape[1]
    for i, page in enumerate(pages):
        lo, hi = i * page_bytes, min((i + 1) * page_bytes, row_bytes)
        if save:
            page_arena[page, : hi - lo].copy_(state_arena[row, lo:hi])  # [hi - lo]
        else:
            state_arena[row, lo:hi].copy_(page_arena[page, : hi - lo])  # [hi - lo]


def copy_state_run(
    page_arena: torch.Tensor, state_arena: torch.Tensor, row: int, pages: Sequence[int], save: bool
) -> None:
    """As `copy_state_run_reference`, with one scatter (save) or gather (restore) over the full pages and
    one copy of the last, partial one."""
    check_run(page_arena, state_arena, row, pages)
    page_bytes, row_bytes = int(page_arena.shape[1]), int(state_arena.shape[1])
    full, rest = divmod(row_bytes, page_bytes)
    whole = torch.tensor(list(pages[:full]), dtype=torch.long, device=page_arena.device)
    if save:
        page_arena.index_copy_(0, whole, state_arena[row, : full * page_bytes].view(full, page_bytes))  # [full, P]
        if rest:
            page_arena[pages[full], :rest].copy_(state_arena[row, full * page_bytes :])  # [rest]
    else:
        state_arena[row, : full * page_bytes].view(full, page_bytes).copy_(page_arena.index_select(0, whole))
        if rest:
            state_arena[row, full * page_bytes :].copy_(page_arena[pages[full], :rest])  # [rest]
