"""`StateImageMover`: state checkpoints as rows the tiers store, one row per checkpoint.

A checkpoint of a model with recurrent state is a state row (every state
layer, `runtime.arena`'s state arena, one per TP shard) and, when its
position is not page-aligned, the attention page of each token group that
holds its tail tokens. Its *image* puts both in one row of fixed size::

    image = [ state row (shard 0) | state row (shard 1) | ... | tail page, group 0 | tail page, group 1 | ... ]

where a tail page is `PageMover`'s row of that page (every shard). A
checkpoint without a tail has zeros there. The tiers (`KVConnector`: host
rows, disk files, Redis values, with the checked page format) store images by
checkpoint key exactly as they store pages by prefix hash; the ids a
`KVConnector` passes are state rows, and `bind` tells which attention pages
go with a row (a checkpoint's tail pages when it is offloaded, the resuming
request's own pages when it is loaded). A checkpoint kept in a run of
attention pages (`core.state.checkpoints`, run mode) is offloaded under the id
`run_id(run[0])`, bound to its run: its state part is read from those pages
(`page_arenas`, laid out as `ops.state_runs` writes them). Images load into
state rows only (a resuming request's live row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.offload.transfer import PageMover

__all__ = ["StateImageMover"]


class StateImageMover:
    """Copies checkpoint images between `state_arenas` (+ attention pages, through `pages`) and host rows."""

    def __init__(
        self, state_arenas: Sequence[torch.Tensor], pages: PageMover, tail_groups: int,
        page_arenas: Sequence[torch.Tensor] = (),
    ) -> None:  # fmt: skip
        if not state_arenas:
            raise ValueError("a state image needs state arenas (a model with recurrent state)")
        self.arenas = list(state_arenas)  # uint8 [state rows, state row bytes] per shard
        self.page_arenas = list(page_arenas)  # uint8 [pages, page bytes] per shard (checkpoints kept in runs)
        self.num_rows = int(self.arenas[0].shape[0])
        self.pages = pages
        self.tail_groups = tail_groups
        self.state_bytes = sum(int(a.shape[1]) for a in self.arenas)
        self.widths = [int(a.shape[1]) for a in self.arenas] + [pages.row_bytes] * tail_groups
        self.row_bytes = sum(self.widths)
        self.cuda = any(a.device.type == "cuda" for a in self.arenas) or pages.cuda
        self._tails: dict[int, tuple[int, ...]] = {}
        self._runs: dict[int, tuple[int, ...]] = {}  # run id -> the pages holding its state

    @property
    def num_pages(self) -> int:
        """Ids: state rows, then one per attention page (`run_id`), the null row last."""
        return self.num_rows + (int(self.page_arenas[0].shape[0]) if self.page_arenas else 0)

    def run_id(self, first_page: int) -> int:
        """The id of a checkpoint kept in a run starting at attention page `first_page`."""
        return self.num_rows - 1 + first_page  # (rows [0, num_rows - 1) are state rows; the null row is last)

    def bind(self, row: int, tail_pages: Sequence[int], run: Sequence[int] = ()) -> None:
        """Pair id `row` with attention pages (one per token group, or none) and, for a `run_id`, with the run
        of pages holding its state, until bound again."""
        if tail_pages and len(tail_pages) != self.tail_groups:
            raise ValueError(f"tail_pages has {len(tail_pages)} pages, expected {self.tail_groups} (one per group)")
        if (row >= self.num_rows - 1) != bool(run):
            raise ValueError(f"id {row} is {'not ' if run else ''}a run id (state rows are [0, {self.num_rows - 1}))")
        self._tails[row] = tuple(tail_pages)
        if run:
            self._runs[row] = tuple(run)

    def to_rows(self, block_ids: Sequence[int], rows: torch.Tensor, slots: Sequence[int]) -> None:
        """``rows[slots[i]]`` = the image of state row ``block_ids[i]`` and its bound tail pages."""
        for row, slot in zip(block_ids, slots, strict=True):
            off, run = 0, self._runs.get(row, ())
            for s, arena in enumerate(self.arenas):
                width = int(arena.shape[1])
                if run:  # the run's pages end to end, cut to the row's bytes
                    page_arena = self.page_arenas[s]
                    index = torch.tensor(run, dtype=torch.long, device=page_arena.device)
                    state = page_arena.index_select(0, index).view(-1)[:width]  # [width]
                else:
                    state = arena[row]  # [width]
                rows[slot, off : off + width].copy_(state, non_blocking=arena.device.type == "cuda")
                off += width
            tails = self._tails.get(row, ())
            if tails:
                # [tail_groups, page row] view of the image's tail part, filled page by page
                tail_rows = rows[slot, off:].view(self.tail_groups, self.pages.row_bytes)
                self.pages.to_rows(list(tails), tail_rows, range(self.tail_groups))
            else:
                rows[slot, off:].zero_()

    def from_rows(self, rows: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """State row ``block_ids[i]`` and its bound tail pages = the image in ``rows[slots[i]]`` (state rows
        only: a checkpoint loads into a resuming request's live row)."""
        for slot, row in zip(slots, block_ids, strict=True):
            if row >= self.num_rows - 1:
                raise ValueError(f"id {row} is not a state row (images load into rows [0, {self.num_rows - 1}))")
            off = 0
            for arena in self.arenas:
                width = int(arena.shape[1])
                arena[row].copy_(rows[slot, off : off + width], non_blocking=arena.device.type == "cuda")  # [width]
                off += width
            tails = self._tails.get(row, ())
            if tails:
                tail_rows = rows[slot, off:].view(self.tail_groups, self.pages.row_bytes)  # [tail_groups, page row]
                self.pages.from_rows(tail_rows, range(self.tail_groups), list(tails))

    def sync(self) -> None:
        """Block until every copy issued so far is done."""
        self.pages.sync()
        for arena in self.arenas:
            if arena.device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.synchronize(arena.device)
