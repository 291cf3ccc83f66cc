"""Slow, obviously correct paged KV ops: Python loops over requests, tokens and heads.

These are the source of truth the vectorised and Triton paths are tested
against. Shapes: ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]``;
``key/value [T, H_kv, D]``; ``query [T, H_q, D]``; request b owns tokens
``input_row_offsets[b]:input_row_offsets[b + 1]`` at positions
``cache_lengths[b] + i``.
"""

from __future__ import annotations

import math

import torch

from pagedkv.ops.fp8 import dequantize_reference, quantize_reference

__all__ = ["store_kv_reference", "paged_attention_reference", "read_kv_reference"]


def _slot(lookup_table: torch.Tensor, position: int, page_size: int) -> tuple[int, int]:
    return int(lookup_table[position // page_size]), position % page_size


def store_kv_reference(
    kv_blocks: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write each token's K (and V) of `layer` into its page slot, one token at a time.

    With `kv_scales` (FP8 cache) each (token, head, group) is quantized with its own scale.
    """
    page_size = kv_blocks.shape[3]
    for b in range(cache_lengths.shape[0]):
        start, end = int(input_row_offsets[b]), int(input_row_offsets[b + 1])
        for i in range(end - start):
            page, slot = _slot(lookup_table[b], int(cache_lengths[b]) + i, page_size)
            for kv, tensor in enumerate((key, value)[: kv_blocks.shape[1]]):
                if tensor is None:
                    continue
                x = tensor[start + i]  # [H, D]
                if kv_scales is None:
                    kv_blocks[page, kv, layer, slot] = x.to(kv_blocks.dtype)
                else:
                    q, s = quantize_reference(x, kv_scales.shape[-1], kv_blocks.dtype, kv_scales.dtype)
                    kv_blocks[page, kv, layer, slot] = q
                    kv_scales[page, kv, layer, slot] = s


def read_kv_reference(
    kv_blocks: torch.Tensor,
    lookup_table_row: torch.Tensor,
    length: int,
    kv: int,
    layer: int,
    kv_scales: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The first `length` positions of one request's K (kv=0) or V (kv=1) as [length, H, D]."""
    page_size = kv_blocks.shape[3]
    rows = []
    for pos in range(length):
        page, slot = _slot(lookup_table_row, pos, page_size)
        x = kv_blocks[page, kv, layer, slot]  # [H, D]
        if kv_scales is not None:
            x = dequantize_reference(x, kv_scales[page, kv, layer, slot], dtype)
        rows.append(x.to(dtype))
    return torch.stack(rows) if rows else kv_blocks.new_zeros((0, *kv_blocks.shape[4:]), dtype=dtype)


def paged_attention_reference(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    lookup_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each query token over its request's cached and new keys.

    Token i of request b (position p = cache_lengths[b] + i) attends positions
    0..p. Query head h reads KV head ``h // (H_q // H_kv)`` (GQA). Logits are
    ``q.k * scale`` (default 1/sqrt(D)), then ``softcap * tanh(logits / softcap)``
    if `softcap` is set. Computed in float32; returns [T, H_q, D] in query's dtype.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_blocks.shape[4]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b in range(cache_lengths.shape[0]):
        start, end = int(input_row_offsets[b]), int(input_row_offsets[b + 1])
        total = int(cache_lengths[b]) + end - start
        keys = read_kv_reference(kv_blocks, lookup_table[b], total, 0, layer, kv_scales)  # [S, H_kv, D]
        values = read_kv_reference(kv_blocks, lookup_table[b], total, kv_blocks.shape[1] - 1, layer, kv_scales)
        for i in range(end - start):
            visible = int(cache_lengths[b]) + i + 1
            for h in range(num_q_heads):
                q = query[start + i, h].float()  # [D]
                logits = keys[:visible, h // group] @ q * scale  # [visible]
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                weights = torch.softmax(logits, dim=0)  # [visible]
                out[start + i, h] = weights @ values[:visible, h // group]  # [D]
    return out.to(query.dtype)
