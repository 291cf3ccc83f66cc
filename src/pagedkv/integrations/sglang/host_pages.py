"""`HostPages`: zero-copy byte views of the pages of an SGLang MHA host pool (`MHATokenToKVPoolHost`).

A stored page is the pool's flat data page (`get_data_page(index).flatten()`): K of the page's
tokens in the pool's layout, then V. In memory those bytes are not adjacent (K and V are two
halves of ``kv_buffer``; ``layer_first`` splits them per layer too), so a page is handed to the
tiers as its parts, in that order, and read from / written into the pool in place:

    layout              parts per page                     one part
    page_first          2       K, V                       [page, layers, heads, head_dim]
    page_first_direct   2       K, V                       [layers, page, heads, head_dim]
    page_head           2       K, V                       [heads, page, layers, head_dim]
    layer_first         2 x layers  K of each layer, V ...  [page, heads, head_dim]

The parts of page ``p`` are at ``offset + p * stride`` in ``kv_buffer``'s bytes, found once from the
pool's own tensor views of pages 0 and 1, so nothing here restates SGLang's index arithmetic.
Imports torch, not sglang.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LAYOUTS", "HostPages"]

LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")


class HostPages:
    """Byte views of `pool`'s pages. Raises `TypeError` for a pool without ``k_buffer`` / ``v_buffer`` /
    ``kv_buffer`` (MLA, Mamba, ... pools) and `ValueError` for another layout (``page_unified``)."""

    def __init__(self, pool: Any) -> None:
        if not all(hasattr(pool, name) for name in ("kv_buffer", "k_buffer", "v_buffer", "layout", "page_size")):
            raise TypeError(f"{type(pool).__name__} is not an MHA host pool (k_buffer / v_buffer / kv_buffer); "
                            "pagedkv's SGLang backend serves MHATokenToKVPoolHost")  # fmt: skip
        if pool.layout not in LAYOUTS:
            raise ValueError(f"host pool layout {pool.layout!r} is not served; use one of {list(LAYOUTS)} "
                             "(--hicache-mem-layout)")  # fmt: skip
        kv: torch.Tensor = pool.kv_buffer
        if not kv.is_contiguous() or kv.device.type != "cpu":
            raise ValueError(f"the host pool's kv_buffer must be contiguous host memory, not {kv.device} "
                             f"(contiguous: {kv.is_contiguous()})")  # fmt: skip
        self.pool = pool
        self.layout: str = pool.layout
        self.page_size: int = int(pool.page_size)
        self._view = memoryview(kv.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]  # keeps the storage alive
        base = kv.data_ptr()
        first = self._tensors(0)
        self.parts = [(t.data_ptr() - base, t.numel() * t.element_size()) for t in first]
        if not all(t.is_contiguous() for t in first):
            raise ValueError(f"layout {self.layout}: a page part is not contiguous")
        second = self._tensors(1) if pool.page_num > 1 else first
        self.stride = second[0].data_ptr() - first[0].data_ptr()
        if any(b.data_ptr() - a.data_ptr() != self.stride for a, b in zip(first, second, strict=True)):
            raise ValueError(f"layout {self.layout}: page parts do not move by one stride")
        self.row_bytes = sum(n for _, n in self.parts)
        self.shapes = [tuple(t.shape) for t in first[:: max(1, len(first) // 2)]]  # K's and V's part shapes

    def _tensors(self, page: int) -> list[torch.Tensor]:
        pool, i, n = self.pool, page * self.page_size, self.page_size
        if self.layout == "page_first":
            return [pool.k_buffer[i : i + n], pool.v_buffer[i : i + n]]
        if self.layout in ("page_first_direct", "page_head"):
            return [pool.k_buffer[page], pool.v_buffer[page]]
        layers = range(pool.k_buffer.shape[0])
        keys, values = pool.k_buffer, pool.v_buffer
        return [keys[layer, i : i + n] for layer in layers] + [values[layer, i : i + n] for layer in layers]

    def row(self, page: int) -> list[memoryview]:
        """The parts of page `page` (views into the pool: reading them reads the pool, writing writes it)."""
        if not 0 <= page < self.pool.page_num:
            raise IndexError(f"host page {page} is outside the pool's {self.pool.page_num} pages")
        at = page * self.stride
        return [self._view[at + offset : at + offset + n] for offset, n in self.parts]

    def pages_of(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """The host pages that `host_indices` (token slots, `page_size` per page, as SGLang's controller
        passes them) name for `count` keys. `ValueError` if there are not exactly that many slots or a
        page does not start on a page boundary."""
        if host_indices.numel() != count * self.page_size:
            raise ValueError(f"{host_indices.numel()} host slots for {count} pages of {self.page_size}")
        starts = host_indices[:: self.page_size].tolist() if count else []
        if any(s % self.page_size for s in starts):
            raise ValueError(f"host slots {starts} do not start pages of {self.page_size}")
        return [s // self.page_size for s in starts]

    def rows(self, host_indices: torch.Tensor, count: int) -> list[list[memoryview]]:
        """`row` of every page `pages_of` names."""
        return [self.row(p) for p in self.pages_of(host_indices, count)]

    def describe(self) -> list[object]:
        """What decides the meaning of a page's bytes on the pool's side (part of the layout fingerprint)."""
        pool = self.pool
        return [
            ("pool", type(pool).__name__, getattr(pool, "storage_format_tag", None)),
            ("layout", self.layout, self.page_size), ("dtype", str(pool.dtype)),
            ("layers", int(pool.layer_num), int(getattr(pool, "start_layer", 0) or 0),
             int(getattr(pool, "end_layer", 0) or 0)),
            ("heads", int(pool.head_num), int(pool.head_dim), int(getattr(pool, "v_head_dim", pool.head_dim))),
            ("parts", tuple(n for _, n in self.parts), tuple(self.shapes)),
        ]  # fmt: skip
