"""`StagedLoads`: device copies that `KVConnector.load` promised and `KVConnector.complete_loads` runs.

`load` runs inside `BlockManager.alloc`, which is bookkeeping only: it finds
the pages below (host rows, or lower-tier pages fetched and checked into
host rows or a staging buffer, so its answer is final) and records one copy
per device page here. The copies run before anything reads or writes device
pages (`Tiering.before_forward`, swap, offload pushes, `sync`, `close`).

Rules a staged copy keeps until it runs:

- its source stays valid: a host row holds one pin per staged copy (two
  loads of one row pin it twice), a staging buffer is referenced by its copies;
- one copy per device page: staging a page again (it was evicted and loaded
  anew before the copies ran) replaces the older copy and drops its pin, since
  the newest content is what the device prefix cache now names for that page.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.core.hashing import BlockHash

if TYPE_CHECKING:
    from pagedkv.offload.transfer import RowMover

__all__ = ["FailedLoads", "LoadCopyError", "StagedCopy", "StagedLoads"]

# on_failed_loads(device pages, their hashes): those pages never received their KV
FailedLoads = Callable[[list[int], list[BlockHash]], None]


@dataclass(frozen=True)
class StagedCopy:
    """Copy row `row` of `staging` (None: of the host tier's buffer) into device page `page`."""

    page: int
    row: int
    staging: torch.Tensor | None  # uint8 [n, row_bytes], or None for a (pinned) host row
    block_hash: BlockHash  # the hash the device prefix cache holds `page` under


class LoadCopyError(RuntimeError):
    """A staged load's device copy failed: `pages` hold no valid KV for `hashes` (same length).

    Raised by `KVConnector.complete_loads` after every staged row was unpinned
    and the connector's `on_failed_loads` was told: a manager's tiers drop the
    pages from the device prefix cache and roll back every request holding one
    (it gives its pages back from the first such page on and its context moves
    back to match, consistent at once), so calling `alloc` again for those
    requests computes what the pages were to hold (or loads it again).
    """

    def __init__(self, pages: list[int], hashes: list[BlockHash]) -> None:
        super().__init__(f"copying {len(pages)} loaded pages into the device failed (device pages {pages[:8]}"
                         f"{' ...' if len(pages) > 8 else ''}); requests holding them were rolled back: alloc them "
                         "again")  # fmt: skip
        self.pages = pages
        self.hashes = hashes


class StagedLoads:
    """Pending copies by device page, in staging order; `unpin(rows)` drops host-row pins of replaced copies."""

    def __init__(self, unpin: Callable[[list[int]], None]) -> None:
        self._unpin = unpin
        self._copies: dict[int, StagedCopy] = {}

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def pages(self) -> frozenset[int]:
        """Device pages whose staged copy has not run: their bytes are not their KV yet."""
        return frozenset(self._copies)

    def add(self, copy: StagedCopy) -> None:
        """Stage `copy`; an older copy into the same device page is dropped (and its host row unpinned)."""
        old = self._copies.pop(copy.page, None)
        self._copies[copy.page] = copy
        if old is not None and old.staging is None:  # (a replaced staging row is simply never copied)
            self._unpin([old.row])

    def complete(self, mover: RowMover, host_rows: torch.Tensor | None) -> int:
        """Copy every staged row into its device page with `mover` (`host_rows`: the host tier's
        buffer, uint8 [H, row_bytes]), wait for the copies, unpin the host rows; returns how many.

        On a failed copy the rows are unpinned all the same (after waiting for copies in flight),
        nothing stays staged, and `LoadCopyError` names every page of the batch (any may be unwritten).
        """
        copies, self._copies = list(self._copies.values()), {}
        pinned = [c.row for c in copies if c.staging is None]
        try:
            groups: dict[int, tuple[torch.Tensor, list[StagedCopy]]] = {}
            for c in copies:
                source = c.staging if c.staging is not None else host_rows
                assert source is not None, "a host row was staged without a host tier"
                groups.setdefault(id(source), (source, []))[1].append(c)
            for source, group in groups.values():
                mover.from_rows(source, [c.row for c in group], [c.page for c in group])
            mover.sync()
        except Exception as exc:
            with contextlib.suppress(Exception):
                mover.sync()  # no copy in flight still reads a row about to be unpinned
            if pinned:
                self._unpin(pinned)
            raise LoadCopyError([c.page for c in copies], [c.block_hash for c in copies]) from exc
        if pinned:
            self._unpin(pinned)
        return len(copies)
