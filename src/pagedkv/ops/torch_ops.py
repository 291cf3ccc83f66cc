"""Vectorised torch paged KV ops, tested against `pagedkv.ops.reference`.

Shapes: ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]`` (kv 0 = K, kv
``kv_dim - 1`` = V, so MLA's single slot serves both); ``key/value/query
[T, ..., D]`` ragged over the batch's requests as described by `PagedMetadata`.

`store_kv` writes every token with one advanced-index assignment per K/V.
`paged_attention` takes one of two paths:

* CPU decode (every request has one new token): a loop over tokens that
  gathers the request's pages, a few MiB at a time, into a reused buffer with
  one `index_select` (the copy is still in cache when it is read), runs SDPA's
  flash kernel on each chunk with the GQA group folded into the query axis
  (``[H_kv, group, D]``, much faster on CPU than ``enable_gqa=True``) and
  merges the chunks by their logsumexp.
* everything else (prefill chunks, mixed batches, any device): requests are
  padded to the batch's longest query and key windows, in groups small enough
  that the float32 K/V and logits stay within ``_CHUNK_BYTES``, and attend in
  float32 under a causal boolean mask: SDPA, or explicit matmuls when a
  softcap is set. No host sync on CUDA: the padded sizes come from the
  metadata's host ints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.ops.fp8 import fp8_max, fp8_scales
from pagedkv.ops.metadata import PagedMetadata

__all__ = ["store_kv", "paged_attention", "quantize", "dequantize"]

_CHUNK_BYTES = 64 * 2**20  # float32 working set of one padded group (K + V, or logits)
_CHUNK_KV_BYTES = 8 * 2**20  # CPU decode: K + V gathered per chunk, merged by logsumexp
_LOOP_MIN_KEYS = 48  # CPU decode: below about this many keys per token the padded path is as fast
# SDPA's CPU flash kernel, which also returns the logsumexp that merging chunks needs (None: explicit path).
_FLASH: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


# ----------------------------------------------------------------------------- FP8
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


# ----------------------------------------------------------------------------- store
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
    reference. Raises ValueError on a shape mismatch.
    """
    tensors = (key,) if value is None else (key, value)
    if len(tensors) > kv_blocks.shape[1]:
        raise ValueError(f"value given for a cache with kv_dim={kv_blocks.shape[1]} (MLA stores K only)")
    for x in tensors:
        if tuple(x.shape) != (meta.num_tokens, *kv_blocks.shape[4:]):
            raise ValueError(
                f"K/V shape {tuple(x.shape)} != [T={meta.num_tokens}, H_kv, D]={tuple(kv_blocks.shape[4:])}"
            )
    page, slot = meta.slot_page, meta.slot_offset  # [T], [T]
    for kv, x in enumerate(tensors):
        if kv_scales is None:
            kv_blocks[page, kv, layer, slot] = x.to(kv_blocks.dtype)  # [T, H_kv, D]
            continue
        q, s = quantize(x, kv_scales.shape[-1], kv_blocks.dtype, kv_scales.dtype)  # [T, H, D], [T, H, G]
        # index_put has no float8_e8m0fnu kernel: write raw bytes (both dtypes are one byte wide)
        kv_blocks.view(torch.uint8)[page, kv, layer, slot] = q.view(torch.uint8)
        kv_scales.view(torch.uint8)[page, kv, layer, slot] = s.view(torch.uint8)


# ----------------------------------------------------------------------------- attention
def paged_attention(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float | None,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention of query [T, H_q, D] over the paged K/V of `layer`; returns [T, H_q, D] in query's dtype.

    Token t attends positions ``0..meta.token_position[t]`` of its request
    (GQA: query head h reads KV head ``h // (H_q // H_kv)``). Logits are
    ``q.k * scale`` (default 1/sqrt(D)), soft-capped as ``softcap * tanh(x / softcap)``
    if given; accumulation is float32 (fp16/bf16 through SDPA's float32 accumulators).
    Matches `paged_attention_reference`. Raises ValueError on a shape mismatch.
    """
    num_tokens, num_q_heads, head_dim = _check_query(query, kv_blocks, meta)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if num_tokens == 0:
        return query.new_empty(query.shape)
    max_q, max_kv = _max_lengths(meta)
    contiguous = kv_blocks.is_contiguous() and (kv_scales is None or kv_scales.is_contiguous())
    if query.device.type == "cpu" and max_q == 1 and max_kv >= _LOOP_MIN_KEYS and contiguous:
        return _decode_loop(query, kv_blocks, meta, layer, scale, softcap, kv_scales)
    return _padded_attention(query, kv_blocks, meta, layer, scale, softcap, kv_scales, max_q, max_kv)


def _check_query(query: torch.Tensor, kv_blocks: torch.Tensor, meta: PagedMetadata) -> tuple[int, int, int]:
    num_kv_heads, head_dim = kv_blocks.shape[4], kv_blocks.shape[5]
    if query.dim() != 3 or query.shape[0] != meta.num_tokens or query.shape[2] != head_dim:
        raise ValueError(f"query shape {tuple(query.shape)} != [T={meta.num_tokens}, H_q, D={head_dim}]")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"H_q={query.shape[1]} query heads is not a multiple of H_kv={num_kv_heads}")
    return query.shape[0], query.shape[1], head_dim


def _max_lengths(meta: PagedMetadata) -> tuple[int, int]:
    """(longest query window, longest key window): exact on CPU, the metadata's host ints elsewhere."""
    if meta.cache_lengths.device.type != "cpu" or meta.num_requests == 0:
        return meta.max_q_len, meta.max_kv_len
    q_lens = meta.input_row_offsets[1:] - meta.input_row_offsets[:-1]  # [B]
    return int(q_lens.max()), int(meta.kv_lengths.max())


def _compute_dtype(query: torch.Tensor, kv_blocks: torch.Tensor, softcap: float | None) -> torch.dtype:
    """SDPA runs in the cache dtype when query and cache agree; explicit paths and FP8 use float32."""
    same = query.dtype == kv_blocks.dtype and kv_blocks.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return kv_blocks.dtype if same and softcap is None else torch.float32


def _read(
    kv_blocks: torch.Tensor, pages: torch.Tensor, kv: int, layer: int, kv_scales: torch.Tensor | None, num_keys: int
) -> torch.Tensor:
    """K (kv=0) or V of `pages` [..., n] as [..., num_keys, H, D]; FP8 is dequantized to float32."""
    x = kv_blocks[:, kv, layer][pages].flatten(-4, -3)[..., :num_keys, :, :]  # [..., S, H, D]
    if kv_scales is None:
        return x
    s = kv_scales[:, kv, layer][pages].flatten(-4, -3)[..., :num_keys, :, :]  # [..., S, H, G]
    return dequantize(x, s)


def _decode_loop(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """One token at a time (CPU): its keys in chunks of ~``_CHUNK_KV_BYTES``, merged by logsumexp.

    Each chunk's K and V pages are gathered by one `index_select` into a buffer
    reused for the whole call, so the copy is still in cache when SDPA reads it.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    kv_dim, num_layers, page_size, num_kv_heads = kv_blocks.shape[1:5]
    dtype = _compute_dtype(query, kv_blocks, softcap)
    q = query.to(dtype).reshape(num_tokens, num_kv_heads, -1, head_dim)  # [T, H_kv, g, D]
    out = torch.empty(q.shape, dtype=query.dtype)  # [T, H_kv, g, D]
    requests, positions = meta.token_request.tolist(), meta.token_position.tolist()
    itemsize = max(kv_blocks.element_size(), dtype.itemsize)  # FP8 pages are read as float32
    page_bytes = kv_dim * page_size * num_kv_heads * head_dim * itemsize
    chunk = min(max(1, _CHUNK_KV_BYTES // page_bytes), -(-(max(positions) + 1) // page_size))  # pages per chunk
    rows = kv_blocks.view(-1, page_size * num_kv_heads * head_dim)  # [(P + 1) * kv_dim * L, page]
    k_rows = meta.lookup_table * (kv_dim * num_layers) + layer  # [B, C]: row of each page's K; V is `L` further
    buf = rows.new_empty((kv_dim * chunk, rows.shape[1]))  # [kv_dim * chunk, page]
    s_rows = s_buf = None
    if kv_scales is not None:
        s_rows = kv_scales.view(-1, page_size * num_kv_heads * kv_scales.shape[-1])  # like `rows`
        s_buf = s_rows.new_empty((kv_dim * chunk, s_rows.shape[1]))
    for t in range(num_tokens):
        num_keys, q_t = positions[t] + 1, q[t : t + 1]  # q_t [1, H_kv, g, D]
        pages = k_rows[requests[t], : -(-num_keys // page_size)]  # [n]
        parts = []
        for c0 in range(0, pages.shape[0], chunk):
            ids = pages[c0 : c0 + chunk]  # [m]
            ids = ids if kv_dim == 1 else torch.cat((ids, ids + num_layers))  # [kv_dim * m]: K rows, then V rows
            x = torch.index_select(rows, 0, ids, out=buf[: ids.shape[0]])  # [kv_dim * m, page]
            x = x.view(kv_dim, -1, num_kv_heads, head_dim)  # [kv_dim, m * page_size, H_kv, D]
            if s_rows is not None and s_buf is not None:
                s = torch.index_select(s_rows, 0, ids, out=s_buf[: ids.shape[0]])  # [kv_dim * m, page of scales]
                x = dequantize(x, s.view(kv_dim, x.shape[1], num_kv_heads, -1))  # float32
            x = x[:, : num_keys - c0 * page_size].to(dtype)  # [kv_dim, S_c, H_kv, D]
            parts.append(_attend_chunk(q_t, x[0], x[-1], scale, softcap))
        out[t] = parts[0][0] if len(parts) == 1 else _merge(parts)
    return out.view(num_tokens, num_q_heads, head_dim)


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H_kv, g, D] over every key of k, v [S, H_kv, D]: (output [H_kv, g, D], float32 logsumexp [H_kv, g])."""
    if softcap is None and _FLASH is not None:
        o, lse = _FLASH(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)  # [1, H_kv, g, D]
        return o[0], lse[0]
    logits = torch.matmul(q[0].float(), k.float().permute(1, 2, 0)) * scale  # [H_kv, g, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    o = torch.matmul(torch.softmax(logits, dim=-1), v.float().transpose(0, 1))  # [H_kv, g, D]
    return o, torch.logsumexp(logits, dim=-1)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine chunk outputs [H_kv, g, D] by their logsumexps [H_kv, g] (float32)."""
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)  # [C, H_kv, g]
    outs = torch.stack([o.float() for o, _ in parts])  # [C, H_kv, g, D]
    return (outs * weights.unsqueeze(-1)).sum(dim=0)  # [H_kv, g, D]


def _padded_attention(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    max_q: int,
    max_kv: int,
) -> torch.Tensor:
    """General path: queries padded to [B, max_q], keys to [B, max_kv], in groups of requests and query blocks."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, page_size, device = kv_blocks.shape[4], meta.page_size, query.device
    batch, v_index = meta.num_requests, kv_blocks.shape[1] - 1
    local = torch.arange(num_tokens, device=device) - meta.input_row_offsets[meta.token_request]  # [T]
    q_pad = torch.zeros((batch, max_q, num_q_heads, head_dim), dtype=torch.float32, device=device)
    q_pad[meta.token_request, local] = query.float()  # [B, max_q, H_q, D]
    out_pad = torch.zeros_like(q_pad)  # [B, max_q, H_q, D]
    q_pos = meta.cache_lengths[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
    k_pos = torch.arange(max_kv, device=device)  # [S]
    num_pages = min(-(-max_kv // page_size), meta.lookup_table.shape[1])
    group = max(1, _CHUNK_BYTES // (8 * max_kv * num_kv_heads * head_dim))  # requests whose fp32 K+V fit
    for b0 in range(0, batch, group):
        b1 = min(batch, b0 + group)
        pages = meta.lookup_table[b0:b1, :num_pages]  # [G, n]
        k = _read(kv_blocks, pages, 0, layer, kv_scales, max_kv).float()  # [G, S, H_kv, D] (a fresh copy)
        v = k if v_index == 0 else _read(kv_blocks, pages, v_index, layer, kv_scales, max_kv).float()  # MLA: V is K
        # stale slots past a request's keys never reach the output, not even as NaN * 0 or NaN - inf
        stale = (k_pos >= meta.kv_lengths[b0:b1, None])[:, :, None, None]  # [G, S, 1, 1]
        k.masked_fill_(stale, 0.0)
        v.masked_fill_(stale, 0.0)
        block = max(1, _CHUNK_BYTES // (4 * (b1 - b0) * num_q_heads * max_kv))  # query rows whose logits fit
        for i0 in range(0, max_q, block):
            i1 = min(max_q, i0 + block)
            mask = k_pos <= q_pos[b0:b1, i0:i1, None]  # [G, Q, S]
            out_pad[b0:b1, i0:i1] = _attend_masked(q_pad[b0:b1, i0:i1], k, v, mask, scale, softcap)
    return out_pad[meta.token_request, local].to(query.dtype)  # [T, H_q, D]


def _attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """float32 q [G, Q, H_q, D] over k, v [G, S, H_kv, D] where mask [G, Q, S] is True: returns [G, Q, H_q, D]."""
    groups, rows, num_q_heads, head_dim = q.shape
    num_kv_heads, keys = k.shape[2], k.shape[1]
    ratio = num_q_heads // num_kv_heads
    qh = q.view(groups, rows, num_kv_heads, ratio, head_dim).permute(0, 2, 3, 1, 4)  # [G, H_kv, g, Q, D]
    qh = qh.reshape(groups, num_kv_heads, ratio * rows, head_dim)  # [G, H_kv, g*Q, D]
    if softcap is None:  # SDPA's fused kernel: no [G, H_q, Q, S] logits in memory
        folded = mask[:, None].expand(groups, ratio, rows, keys).reshape(groups, 1, ratio * rows, keys)
        out = F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=folded, scale=scale)
    else:
        out = _attend_explicit(qh, k, v, mask, scale, softcap)  # [G, H_kv, g*Q, D]
    out = out.view(groups, num_kv_heads, ratio, rows, head_dim).permute(0, 3, 1, 2, 4)  # [G, Q, H_kv, g, D]
    return out.reshape(groups, rows, num_q_heads, head_dim)


def _attend_explicit(
    qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Soft-capped float32 attention of qh [G, H_kv, g*Q, D] over k, v [G, S, H_kv, D]: returns [G, H_kv, g*Q, D]."""
    groups, num_kv_heads, folded, _ = qh.shape
    keys, rows = k.shape[1], mask.shape[1]
    ratio = folded // rows
    logits = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale  # [G, H_kv, g*Q, S]
    logits = torch.tanh(logits.view(groups, num_kv_heads, ratio, rows, keys) / softcap) * softcap  # [G, H_kv, g, Q, S]
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))  # [G, H_kv, g, Q, S]
    weights = torch.softmax(logits, dim=-1).view(groups, num_kv_heads, ratio * rows, keys)  # [G, H_kv, g*Q, S]
    return torch.matmul(weights, v.permute(0, 2, 1, 3))  # [G, H_kv, g*Q, D]
