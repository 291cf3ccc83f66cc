"""`BlockMover`: whole blocks between vLLM's paged KV views and page rows, by block id.

vLLM 0.33 allocates one int8 buffer and gives each layer a strided view that
is logically ``[num_blocks, H, N, C]`` (`vllm.v1.worker.utils.allocate_kv_cache`);
the physical order is a permutation of ``[L, B, H, N, C]`` (``LBNHC`` by default
on GPU, ``LBHNC`` on CPU, ``BLNHC``...). A page row (`layout.BlockLayout`) is
``[L, H, N, C]`` bytes of one block. When every layer is the same view shifted
by a constant byte stride (vLLM's own allocation), the mover sees the whole
cache as one strided ``[B, L, H, N, C]`` byte view and moves a batch of blocks
with one ``index_select`` / ``index_copy_``; otherwise it copies layer by layer.
No copy depends on the physical order, so engines of different layouts share
pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["BlockMover"]


def _bytes(view: torch.Tensor) -> torch.Tensor:
    """A layer's ``[B, H, N, C]`` view as bytes: ``uint8 [B, H, N, C * itemsize]`` (same storage)."""
    if view.dim() != 4 or view.stride(-1) != 1:
        raise ValueError(f"a vLLM KV layer view must be 4-d [B, H, N, C] with a contiguous last axis, got "
                         f"shape {tuple(view.shape)} strides {view.stride()}")  # fmt: skip
    return view.view(torch.uint8)  # [B, H, N, C bytes]


def _stacked(views: list[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one ``uint8 [B, L, H, N, C]`` strided view of the shared buffer, or None when the
    layers are not one buffer at a constant layer stride (then they are copied one by one)."""
    first = views[0]
    base = first.untyped_storage().data_ptr()
    if any(v.shape != first.shape or v.stride() != first.stride() for v in views):
        return None
    if any(v.untyped_storage().data_ptr() != base for v in views):
        return None
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else first.numel()
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    num_blocks, h, n, c = first.shape
    sb, sh, sn, sc = first.stride()
    return first.as_strided((num_blocks, len(views), h, n, c), (sb, step, sh, sn, sc), offsets[0])


class BlockMover:
    """Copies blocks of vLLM's per-layer KV views (`kv_caches` in `layer_names` order) to and from page
    rows ``uint8 [n, row_bytes]``. Holds views, never copies of the cache."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str]) -> None:
        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches got no tensor for layer(s) {missing[:4]} of the KV cache group")
        self.layers = [_bytes(kv_caches[name]) for name in layer_names]  # each uint8 [B, H, N, C]
        shapes = {tuple(v.shape) for v in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"the group's layers have different block shapes {sorted(shapes)}")
        self.num_blocks, h, n, c = self.layers[0].shape
        self.block_shape = (len(self.layers), h, n, c)  # a row, [L, H, N, C] bytes
        self.layer_bytes = h * n * c
        self.row_bytes = len(self.layers) * self.layer_bytes
        self.device = self.layers[0].device
        self.stacked = _stacked(self.layers)  # uint8 [B, L, H, N, C] or None
        self.dense = all(v[0].is_contiguous() for v in self.layers)  # each layer's block is one run of bytes
        self._host = self._host_views() if self.dense and not self.cuda else None

    def _host_views(self) -> list[tuple[memoryview, int, int]]:
        """Per layer: (a byte view of its whole storage, the byte offset of block 0, bytes between blocks)."""
        storages: dict[int, memoryview] = {}
        out = []
        for view in self.layers:
            storage = view.untyped_storage()
            if storage.data_ptr() not in storages:
                flat = torch.empty(0, dtype=torch.uint8).set_(storage)  # the layer's whole buffer, as bytes
                storages[storage.data_ptr()] = memoryview(flat.numpy())  # type: ignore[arg-type]  # holds `flat` alive
            out.append((storages[storage.data_ptr()], int(view.storage_offset()), int(view.stride(0))))
        return out

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(list(block_ids), dtype=torch.long)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {list(block_ids)[:8]}")
        return index.to(self.device, non_blocking=True)

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """``rows[i] = block block_ids[i]`` (device -> host). `rows`: ``uint8 [len(block_ids), row_bytes]``,
        each row contiguous (rows may be further apart: staging rows with header room; pinned for a CUDA
        cache). Synchronous: returns once `rows` holds the bytes."""
        if self._host is not None and rows.device.type == "cpu":
            self._gather_host(block_ids, rows)
            return
        index = self._index(block_ids)
        out = rows.view(len(block_ids), *self.block_shape)  # [n, L, H, N, C]
        if self.stacked is not None and not self.cuda:
            torch.index_select(self.stacked, 0, index, out=out)  # one strided gather, straight into the rows
        elif self.stacked is not None:  # pragma: no cover - needs a GPU
            out.copy_(self.stacked.index_select(0, index))
        else:
            for layer, view in enumerate(self.layers):
                out[:, layer].copy_(view.index_select(0, index))  # [n, H, N, C]

    def _gather_host(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """`gather` on a host cache of dense layer blocks: one memcpy per (block, layer) on this thread.
        Not `index_select`: its OpenMP threads wait for each other, and beside the tier's writer threads
        on a machine of few cores one step's gather took 100-360 ms instead of 4-30."""
        parts = self.block_parts(block_ids)
        assert parts is not None
        size = self.layer_bytes
        for i, block in enumerate(parts):
            row = memoryview(rows[i].numpy())  # type: ignore[arg-type]
            if row.nbytes != self.row_bytes or not row.c_contiguous:
                raise ValueError(f"rows must be uint8 [n, {self.row_bytes}] with each row contiguous")
            for layer, part in enumerate(block):
                row[layer * size : (layer + 1) * size] = part

    def block_parts(self, block_ids: Sequence[int]) -> list[list[memoryview]] | None:
        """Per block: its bytes in the KV cache as the parts of one page row (one writable view per layer,
        in row order), for reading pages straight into the cache; None when the cache is not host memory
        with each layer's block one run of bytes (then pages go through `scatter`). Views, no copy."""
        if self._host is None:
            return None
        self._index(block_ids)  # range check
        size = self.layer_bytes
        return [[mv[off + b * step : off + b * step + size] for mv, off, step in self._host] for b in block_ids]

    def scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """``block block_ids[i] = rows[i]`` (host -> device); synchronous. `rows`: ``uint8 [n, row_bytes]``."""
        index = self._index(block_ids)
        src = rows.view(len(block_ids), *self.block_shape)  # [n, L, H, N, C]
        if self.cuda:  # pragma: no cover - needs a GPU
            src = src.to(self.device, non_blocking=True)
        if self.dense and not self.cuda:  # a memcpy per (layer, block): faster than a strided index_copy_
            for layer, view in enumerate(self.layers):
                part = src[:, layer]  # [n, H, N, C]
                for i, block in enumerate(block_ids):
                    view[block].copy_(part[i])
        elif self.stacked is not None:
            self.stacked[index] = src  # index_put_: faster than index_copy_ on a strided view
        else:
            for layer, view in enumerate(self.layers):
                view.index_copy_(0, index, src[:, layer])
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(self.device).synchronize()
