"""Copy the leading token slots of one page into another, in place (partial-page copy-on-write).

A page tensor is ``[pages, kv_dim, num_layers, page_size, heads, head_dim]`` (values; the last
dim is the scale groups for FP8 scales). A copy ``(src, dst, n)`` does::

    pages[dst, :, :, :n] = pages[src, :, :, :n]      # every K/V, layer, head; token slots 0..n-1

Bytes move exactly: elements are reinterpreted as integers of their width, so every dtype (FP8,
e8m0 scales included) copies bit for bit on any device. `copy_page_slots_reference` loops over
copies and slots (the source of truth); `copy_page_slots` does one gather and one scatter.

This module sits at the manager's layer (it imports nothing from pagedkv): `PagedKVCacheManager`
applies the pending copies of its replicas in `runtime_inputs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["check_copies", "copy_page_slots", "copy_page_slots_reference"]

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_copies(pages: torch.Tensor, copies: Sequence[tuple[int, int, int]]) -> None:
    """ValueError unless `pages` is 6-D and each ``(src, dst, n)`` has pages in range, ``0 <= n <=
    page_size``, distinct destinations and no destination that is also a source (so the order of
    the copies does not matter)."""
    if pages.dim() != 6:
        raise ValueError(f"pages must be [pages, kv_dim, layers, page_size, heads, dim], got {tuple(pages.shape)}")
    n_pages, page_size = pages.shape[0], pages.shape[3]
    for src, dst, n in copies:
        if not (0 <= src < n_pages and 0 <= dst < n_pages and src != dst and 0 <= n <= page_size):
            raise ValueError(f"page copy ({src}, {dst}, {n}) is invalid for {n_pages} pages of {page_size} slots")
    dsts = [dst for _, dst, _ in copies]
    if len(set(dsts)) != len(dsts) or set(dsts) & {src for src, _, _ in copies}:
        raise ValueError(f"page copies {list(copies)} repeat a destination or read one")


def copy_page_slots_reference(pages: torch.Tensor, copies: Sequence[tuple[int, int, int]]) -> None:
    """`copy_page_slots`, one token slot at a time."""
    check_copies(pages, copies)
    for src, dst, n in copies:
        for slot in range(n):
            pages[dst, :, :, slot] = pages[src, :, :, slot]


def copy_page_slots(pages: torch.Tensor, copies: Sequence[tuple[int, int, int]]) -> None:
    """Apply every ``(src, dst, n)`` of `copies` to `pages` in place (see the module docstring)."""
    check_copies(pages, copies)
    counts = np.array([n for _, _, n in copies], dtype=np.int64)  # [C]
    total = int(counts.sum())
    if not total:
        return
    src = np.repeat(np.array([s for s, _, _ in copies], dtype=np.int64), counts)  # [T]
    dst = np.repeat(np.array([d for _, d, _ in copies], dtype=np.int64), counts)  # [T]
    slot = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)  # [T]
    src_t, dst_t, slot_t = (torch.from_numpy(a).to(pages.device) for a in (src, dst, slot))
    raw = pages.view(_INT_OF_WIDTH[pages.element_size()])
    raw[dst_t, :, :, slot_t] = raw[src_t, :, :, slot_t]  # [T, kv_dim, layers, heads, dim]
