"""Vectorised page I/O: FP8 quantization, `store_kv`, and reading pages back (re-exported by `torch_ops`).

Shapes: ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]`` (kv 0 = K, kv
``kv_dim - 1`` = V, so MLA's single slot serves both); ``kv_scales
[P + 1, kv_dim, L, page_size, H_kv, G]`` for FP8 pages.
"""

from __future__ import annotations

import torch

from pagedkv.ops.fp8 import fp8_max, fp8_scales
from pagedkv.ops.metadata import PagedMetadata

__all__ = ["store_kv", "quantize", "dequantize", "read_pages"]


def quantize(
    x: torch.Tensor, num_groups: int, dtype: torch.dtype, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [..., H, D] per (row, head, group): returns (`dtype` [..., H, D], `scale_dtype` [..., H, G]).

    Bit-identical to `fp8.quantize_reference` applied row by row (same
    `fp8_scales`, same division, clamp and rounding).
    """
    dim = x.shape[-1]
    groups = x.float().unflatten(-1, (num_groups, dim // num_groups))  # [..., H, G, D/G]
    scale = fp8_scales(groups.abs().amax(dim=-1), dtype, scale_dtype)  # [..., H, G]
    limit = fp8_max(dtype)
    q = (groups / scale.unsqueeze(-1)).clamp(-limit, limit).to(dtype)  # [..., H, G, D/G]
    return q.flatten(-2), scale.to(scale_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 q [..., H, D] times its per-group scale [..., H, G] (as `fp8.dequantize_reference`)."""
    groups = scale.shape[-1]
    x = q.float().unflatten(-1, (groups, q.shape[-1] // groups)) * scale.float().unsqueeze(-1)  # [..., H, G, D/G]
    return x.flatten(-2)


def store_kv(
    kv_blocks: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    meta: PagedMetadata,
    layer: int,
    kv_scales: torch.Tensor | None,
) -> None:
    """Write K [T, H_kv, D] (and V, None for MLA) of `layer` into slot ``meta.slot_offset`` of ``meta.slot_page``.

    FP8 caches (`kv_scales` [P + 1, kv_dim, L, page_size, H_kv, G]) store each
    (token, head, group) quantized with its own scale, bit-identical to the
    reference. The arguments (shapes, causal metadata) were checked by the
    caller (`pagedkv.ops.store_kv` or `pagedkv.ops.PagedStep`).
    """
    tensors = (key,) if value is None else (key, value)
    page, slot = meta.slot_page, meta.slot_offset  # [T], [T]
    kv_dim, num_layers, page_size = kv_blocks.shape[1:4]
    if kv_blocks.is_contiguous() and (kv_scales is None or kv_scales.is_contiguous()):
        # one index_copy_ per K/V into the slot rows [(P + 1) * kv_dim * L * page_size, H_kv * D] (cheaper than
        # index_put on CPU); FP8 pages and scales are written as raw bytes (no float8_e8m0fnu kernels)
        base = _slot_rows(meta, kv_dim, num_layers, page_size)  # [T]: the rows of K in layer 0
        for kv, x in enumerate(tensors):
            rows = base + (kv * num_layers + layer) * page_size  # [T]
            if kv_scales is None:
                _copy_rows(kv_blocks, rows, x.to(kv_blocks.dtype))  # [T, H_kv, D]
                continue
            q, s = quantize(x, kv_scales.shape[-1], kv_blocks.dtype, kv_scales.dtype)  # [T, H, D], [T, H, G]
            _copy_rows(kv_blocks.view(torch.uint8), rows, q.view(torch.uint8))
            _copy_rows(kv_scales.view(torch.uint8), rows, s.view(torch.uint8))
        return
    for kv, x in enumerate(tensors):
        if kv_scales is None:
            kv_blocks[page, kv, layer, slot] = x.to(kv_blocks.dtype)  # [T, H_kv, D]
            continue
        q, s = quantize(x, kv_scales.shape[-1], kv_blocks.dtype, kv_scales.dtype)  # [T, H, D], [T, H, G]
        # index_put has no float8_e8m0fnu kernel: write raw bytes (both dtypes are one byte wide)
        kv_blocks.view(torch.uint8)[page, kv, layer, slot] = q.view(torch.uint8)
        kv_scales.view(torch.uint8)[page, kv, layer, slot] = s.view(torch.uint8)


def _slot_rows(meta: PagedMetadata, kv_dim: int, num_layers: int, page_size: int) -> torch.Tensor:
    """int64 [T]: each token's K slot row of layer 0 in the blocks' slot rows (`store_kv`); once per step, kept in
    ``meta.plans`` (layer l's K rows are ``l * page_size`` further, V's ``num_layers * page_size`` more)."""
    key = ("slot_rows", kv_dim, num_layers, page_size)
    rows: torch.Tensor | None = meta.plans.get(key)
    if rows is None:
        rows = meta.plans[key] = meta.slot_page * (kv_dim * num_layers * page_size) + meta.slot_offset  # [T]
    return rows


def _copy_rows(blocks: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, H, D] into slot rows `rows` [T] of contiguous blocks [P + 1, kv_dim, L, page_size, H, D]."""
    blocks.view(-1, x.shape[-2] * x.shape[-1]).index_copy_(0, rows, x.flatten(-2))  # [slots, H * D] <- [T, H * D]


def read_pages(
    kv_blocks: torch.Tensor, pages: torch.Tensor, kv: int, layer: int, kv_scales: torch.Tensor | None, num_keys: int
) -> torch.Tensor:
    """K (kv=0) or V of `pages` [..., n] as [..., num_keys, H, D]; FP8 is dequantized to float32."""
    x = kv_blocks[:, kv, layer][pages].flatten(-4, -3)[..., :num_keys, :, :]  # [..., S, H, D]
    if kv_scales is None:
        return x
    s = kv_scales[:, kv, layer][pages].flatten(-4, -3)[..., :num_keys, :, :]  # [..., S, H, G]
    return dequantize(x, s)
