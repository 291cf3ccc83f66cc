"""General path of `torch_ops.paged_attention`: prefill chunks, mixed batches, any device.

Requests are padded to the batch's longest query window and to the keys they may
see (with a sliding window or chunk: the sink-token pages plus the pages from the
first query's window start, so the cost scales with the window, not the context), in
groups small enough that the float32 K/V and logits stay within ``_CHUNK_BYTES``, and
attend in float32 under a boolean mask built from `AttentionOptions.key_ranges`:
SDPA, or explicit matmuls when a softcap, learned sinks or ALiBi slopes are set (the sink
column is appended exactly as transformers' gpt-oss eager attention does; the ALiBi bias
``slope * (k - q)`` is added after the softcap). Gathered keys no
query of the request may see (stale slots, the null page standing in for a windowed
cache's freed pages) are zeroed, so not even NaN reaches the output. No host sync on
CUDA: the padded sizes come from the metadata's host ints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.torch_store import read_pages

__all__ = ["padded_attention"]

_CHUNK_BYTES = 64 * 2**20  # float32 working set of one padded group (K + V, or logits)


def padded_attention(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    options: AttentionOptions,
    max_q: int,
    max_kv: int,
) -> torch.Tensor:
    """Queries padded to [B, max_q], keys to [B, S] (`_key_pages`), in groups of requests and query blocks.

    Returns [T, H_q, Dv].
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, page_size, device = kv_blocks.shape[4], meta.page_size, query.device
    batch, v_index = meta.num_requests, kv_blocks.shape[1] - 1
    sinks, slopes = options.sink_logits(device), options.alibi(device)  # float32 [H_q] each, or None
    local = torch.arange(num_tokens, device=device) - meta.input_row_offsets[meta.token_request]  # [T]
    q_pad = torch.zeros((batch, max_q, num_q_heads, head_dim), dtype=torch.float32, device=device)
    q_pad[meta.token_request, local] = query.float()  # [B, max_q, H_q, D]
    out_pad = torch.zeros_like(q_pad)  # [B, max_q, H_q, D]
    q_pos = meta.cache_lengths[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
    sink_end, lo, hi = (x[..., None] for x in options.key_ranges(q_pos, meta.kv_lengths[:, None]))  # [B, max_q, 1]
    cols, sink_pages = _key_pages(meta, options, max_q, max_kv)  # [B, n]
    k_pos = (cols[:, :, None] * page_size + torch.arange(page_size, device=device)).flatten(1)  # [B, S]: positions
    if not (options.causal and options.local):
        k_pos = k_pos[:, :max_kv]  # plain: exactly the longest key window
    num_keys = k_pos.shape[1]
    in_sink = torch.arange(num_keys, device=device) < sink_pages * page_size  # [S]: the sink-token pages
    # keys no query of the request sees (stale slots, freed pages before the window) are zeroed after the gather;
    # lo[:, 0] is the first query's, the furthest back any of the request's queries sees
    needed = torch.where(in_sink, k_pos < options.sink_tokens, k_pos >= lo[:, 0]) & (k_pos < meta.kv_lengths[:, None])
    pages = cols.clamp(max=meta.lookup_table.shape[1] - 1)  # columns past the table hold no needed key
    group = max(1, _CHUNK_BYTES // (8 * num_keys * num_kv_heads * head_dim))  # requests whose fp32 K+V fit
    for b0 in range(0, batch, group):
        b1 = min(batch, b0 + group)
        ids = meta.lookup_table[b0:b1].gather(1, pages[b0:b1])  # [G, n]
        k = read_pages(kv_blocks, ids, 0, layer, kv_scales, num_keys).float()  # [G, S, H_kv, D] (a fresh copy)
        v = k if v_index == 0 else read_pages(kv_blocks, ids, v_index, layer, kv_scales, num_keys).float()  # MLA: K
        k.masked_fill_(~needed[b0:b1, :, None, None], 0.0)
        v.masked_fill_(~needed[b0:b1, :, None, None], 0.0)
        block = max(1, _CHUNK_BYTES // (4 * (b1 - b0) * num_q_heads * num_keys))  # query rows whose logits fit
        for i0 in range(0, max_q, block):
            i1 = min(max_q, i0 + block)
            rows, keys = (slice(b0, b1), slice(i0, i1)), k_pos[b0:b1, None]  # keys [G, 1, S]
            mask = (keys >= lo[rows]) & (keys < hi[rows])  # [G, Q, S]
            if sink_pages:  # sink pages may repeat window keys: there only ``k < sink_end`` counts
                mask = torch.where(in_sink, keys < sink_end[rows], mask)
            alibi = None
            if slopes is not None:  # (slopes [H_q], key position - query position [G, Q, S])
                alibi = (slopes, (keys - q_pos[rows][..., None]).float())
            out_pad[rows] = _attend_masked(q_pad[rows], k, v, mask, scale, softcap, sinks, alibi)
    v_dim = options.v_head_dim or head_dim
    return out_pad[meta.token_request, local, :, :v_dim].to(query.dtype)  # [T, H_q, Dv]


def _key_pages(meta: PagedMetadata, options: AttentionOptions, max_q: int, max_kv: int) -> tuple[torch.Tensor, int]:
    """(lookup-table columns [B, n] each request gathers, how many leading ones are sink-token pages).

    Plain attention gathers every page up to the longest key window. A window or
    chunk of reach R lets the first query of a request see back to ``lo >= q - R + 1``
    and later ones no further, so the request's keys lie in ``max_q + R - 2 + page_size``
    positions from lo's page: those pages (after the sink-token pages) are all it
    gathers, and cost scales with the window, not the context. Columns may run past
    the table (the caller clamps them; their positions are past every key).
    """
    batch, page_size, device = meta.num_requests, meta.page_size, meta.cache_lengths.device
    all_pages = -(-max_kv // page_size)
    if not (options.causal and options.local):
        return torch.arange(min(all_pages, meta.lookup_table.shape[1]), device=device).expand(batch, -1), 0
    reach = min(x for x in (options.sliding_window, options.chunk_size) if x is not None)
    span = min(all_pages, -(-(max_q + reach - 2) // page_size) + 1)
    first = options.window_start(meta.cache_lengths) // page_size  # [B] page of the first query's lo
    window = first[:, None] + torch.arange(span, device=device)  # [B, span]
    sink_pages = min(-(-options.sink_tokens // page_size), all_pages)
    sink = torch.arange(sink_pages, device=device).expand(batch, -1)  # [B, sink_pages]
    return torch.cat([sink, window], dim=1), sink_pages


def _attend_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """float32 q [G, Q, H_q, D] over k, v [G, S, H_kv, D] where mask [G, Q, S] is True: returns [G, Q, H_q, D].

    `alibi`: (slopes [H_q], key minus query position [G, Q, S]), both float32. Rows with no visible key get zeros.
    """
    groups, rows, num_q_heads, head_dim = q.shape
    num_kv_heads, keys = k.shape[2], k.shape[1]
    ratio = num_q_heads // num_kv_heads
    qh = q.view(groups, rows, num_kv_heads, ratio, head_dim).permute(0, 2, 3, 1, 4)  # [G, H_kv, g, Q, D]
    qh = qh.reshape(groups, num_kv_heads, ratio * rows, head_dim)  # [G, H_kv, g*Q, D]
    if softcap is None and sinks is None and alibi is None:  # SDPA's fused kernel: no [G, H_q, Q, S] logits in memory
        folded = mask[:, None].expand(groups, ratio, rows, keys).reshape(groups, 1, ratio * rows, keys)
        out = F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=folded, scale=scale)
    else:
        out = _attend_explicit(qh, k, v, mask, scale, softcap, sinks, alibi)  # [G, H_kv, g*Q, D]
    out = out.view(groups, num_kv_heads, ratio, rows, head_dim).permute(0, 3, 1, 2, 4)  # [G, Q, H_kv, g, D]
    out = out.reshape(groups, rows, num_q_heads, head_dim)
    return out.masked_fill(~mask.any(dim=-1)[..., None, None], 0.0)


def _attend_explicit(
    qh: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    alibi: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """float32 attention of qh [G, H_kv, g*Q, D] over k, v [G, S, H_kv, D], soft-capped, with the ALiBi bias
    (`alibi`: slopes [H_q], key minus query position [G, Q, S]) and sinks [H_q] if given: returns [G, H_kv, g*Q, D]."""
    groups, num_kv_heads, folded, _ = qh.shape
    keys, rows = k.shape[1], mask.shape[1]
    ratio = folded // rows
    logits = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale  # [G, H_kv, g*Q, S]
    logits = logits.view(groups, num_kv_heads, ratio, rows, keys)  # [G, H_kv, g, Q, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if alibi is not None:
        slopes, delta = alibi
        logits = logits + slopes.view(1, num_kv_heads, ratio, 1, 1) * delta[:, None, None]  # [G, H_kv, g, Q, S]
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))  # [G, H_kv, g, Q, S]
    if sinks is None:
        weights = torch.softmax(logits, dim=-1)
    else:  # transformers' gpt-oss eager: softmax over [logits, sink], minus the row max, then drop the sink
        sink = sinks.view(1, num_kv_heads, ratio, 1, 1).expand(groups, num_kv_heads, ratio, rows, 1)
        combined = torch.cat([logits, sink], dim=-1)  # [G, H_kv, g, Q, S + 1]
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1)[..., :-1]
    weights = weights.reshape(groups, num_kv_heads, ratio * rows, keys)  # [G, H_kv, g*Q, S]
    return torch.matmul(weights, v.permute(0, 2, 1, 3))  # [G, H_kv, g*Q, D]
