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
from pagedkv.ops.masks import AttentionOptions

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
    *,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sink_tokens: int = 0,
    sinks: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query token over the keys its mask lets it see (`pagedkv.ops.masks`).

    Token i of request b (position p = cache_lengths[b] + i) attends positions
    0..p, restricted by `sliding_window` / `chunk_size` (plus the first
    `sink_tokens`), or, when not `causal`, exactly the cached positions
    0..cache_lengths[b] - 1. Query head h reads KV head ``h // (H_q // H_kv)``
    (GQA). Logits are ``q.k * scale`` (default 1/sqrt(D)), then ``softcap *
    tanh(logits / softcap)`` if `softcap` is set, plus ``alibi_slopes[h] * (k - p)``
    for key position k if `alibi_slopes` [H_q] is set; learned `sinks` [H_q] join
    the softmax as one more logit whose probability is dropped. Values are the
    first `v_head_dim` (default D) elements of the V slot. Only visible keys
    enter the sums, so whatever other slots hold (NaN included) never matters;
    a query that sees no key gets zeros. Computed in float32; returns
    [T, H_q, Dv] in query's dtype.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_blocks.shape[4]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    AttentionOptions(sliding_window, chunk_size, sink_tokens, sinks, v_head_dim, causal, alibi_slopes).check(
        num_q_heads, head_dim
    )
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    v_dim = head_dim if v_head_dim is None else v_head_dim
    out = torch.zeros((query.shape[0], num_q_heads, v_dim), dtype=torch.float32, device=query.device)
    for b in range(cache_lengths.shape[0]):
        start, end = int(input_row_offsets[b]), int(input_row_offsets[b + 1])
        cached = int(cache_lengths[b])
        total = cached + end - start if causal else cached
        keys = read_kv_reference(kv_blocks, lookup_table[b], total, 0, layer, kv_scales)  # [S, H_kv, D]
        values = read_kv_reference(kv_blocks, lookup_table[b], total, kv_blocks.shape[1] - 1, layer, kv_scales)
        for i in range(end - start):
            q_pos = cached + i
            visible = [k for k in range(total) if not causal or _visible(k, q_pos, sliding_window, chunk_size,
                                                                         sink_tokens)]  # fmt: skip
            index = torch.tensor(visible, dtype=torch.int64)
            for h in range(num_q_heads):
                q = query[start + i, h].float()  # [D]
                logits = keys[index, h // group] @ q * scale  # [visible]
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if alibi_slopes is not None:  # slope * (key position - query position)
                    logits = logits + float(alibi_slopes[h]) * (index - q_pos).float().to(logits.device)  # [visible]
                if sinks is None:
                    weights = torch.softmax(logits, dim=0)  # [visible]
                else:
                    combined = torch.cat([logits, sinks[h : h + 1].float().to(logits.device)])  # [visible + 1]
                    weights = torch.softmax(combined - combined.max(), dim=0)[:-1]  # the sink's mass is dropped
                out[start + i, h] = weights @ values[index, h // group, :v_dim]  # [Dv]
    return out.to(query.dtype)


def _visible(k: int, q: int, window: int | None, chunk: int | None, sink_tokens: int) -> bool:
    """Causal visibility of key position k to query position q (transformers' mask overlays)."""
    if k > q:
        return False
    if k < sink_tokens:
        return True
    return (window is None or k > q - window) and (chunk is None or k // chunk == q // chunk)
