"""Apply the partial-page copies the bookkeeping queued (``enable_partial_page_reuse``) to the page buffers.

`BlockManager.alloc` may reuse the first tokens of a cached page by queuing a copy of their slots
into the request's own page (`pagedkv.core.partial_pages`). `PagedKVCacheManager.runtime_inputs`
calls `apply_page_copies` before it returns, so the copies land before the forward pass that reads
them; the source pages are held until then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.core.block_manager import BlockManager
from pagedkv.ops.page_copy import copy_page_slots

__all__ = ["apply_page_copies"]


def apply_page_copies(managers: Sequence[BlockManager], buffers: Sequence[Any]) -> int:
    """Take each replica's pending copies and apply them to every tensor of its buffers (each cache
    of a tree, K and V of every layer, every TP shard, FP8 scales). Returns how many copies ran."""
    done = 0
    for bm, buffer in zip(managers, buffers, strict=True):
        copies = bm.take_page_copies()
        for tensor in buffer.all_buffers if copies else ():
            copy_page_slots(tensor, copies)
        done += len(copies)
    return done
