"""CPU decode path of `torch_ops.paged_attention`: one query token per request, a loop over tokens.

Each token gathers only the keys its mask lets it see (`AttentionOptions.key_ranges`:
the sink tokens, then the window or chunk, or everything up to itself), a few MiB
of pages at a time, into a buffer reused for the whole call with one
`index_select` (the copy is still in cache when it is read). SDPA's flash kernel
attends each chunk with the GQA group folded into the query axis (``[H_kv, group,
D]``, much faster on CPU than ``enable_gqa=True``); chunks are merged by their
logsumexp, and learned sinks join the merge as one more chunk with zero output.
ALiBi slopes add ``slope * (k - q)`` to each chunk's logits (the explicit path, not flash).
So a token's cost scales with what it sees, and pages outside its ranges (the null
page of a windowed cache's freed pages included) are never read. Values always run
at the full head_dim (MLA: the whole latent slot) and `v_head_dim` slices the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.torch_store import dequantize

__all__ = ["batched_supported", "decode_batched", "decode_loop"]

_CHUNK_KV_BYTES = 8 * 2**20  # K + V gathered per chunk, merged by logsumexp
_BATCH_KV_BYTES = 64 * 2**20  # K + V one group of tokens of `decode_batched` gathers at once
# SDPA's CPU flash kernel, which also returns the logsumexp that merging chunks needs (None: explicit path).
_FLASH: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


def _compute_dtype(query: torch.Tensor, kv_blocks: torch.Tensor, softcap: float | None) -> torch.dtype:
    """SDPA runs in the cache dtype when query and cache agree; explicit paths and FP8 use float32."""
    same = query.dtype == kv_blocks.dtype and kv_blocks.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return kv_blocks.dtype if same and softcap is None else torch.float32


def _token_ranges(meta: PagedMetadata, options: AttentionOptions) -> list[list[tuple[int, int]]]:
    """Per token, its non-empty visible key ranges ``[start, end)`` (host ints)."""
    kv_len = meta.kv_lengths[meta.token_request]  # [T]
    sink_end, lo, hi = (x.tolist() for x in options.key_ranges(meta.token_position, kv_len))
    return [[(s, e) for s, e in ((0, se), (a, b)) if e > s] for se, a, b in zip(sink_end, lo, hi, strict=True)]


def batched_supported(softcap: float | None, options: AttentionOptions) -> bool:
    """Whether `decode_batched` serves these options: full attention (no window or chunk), no softcap, learned
    sinks or ALiBi (those take the loop, which bounds a window's cost and attends explicitly)."""
    return softcap is None and not options.local and options.sinks is None and options.alibi_slopes is None


@dataclass(frozen=True)
class _Group:
    """One group of `decode_batched`'s tokens, as planned once per step (`_batched_plan`).

    Attributes:
        tokens: int64 [G] the group's tokens (None: every token of the step, in order).
        pages: n, the pages gathered per token.
        rows: int64 [kv_dim * G * n] page rows of layer 0 to gather (K rows, then V rows) in
            ``kv_blocks.view(-1, page)``; layer l's are ``rows + l``.
        num_keys: S, the keys gathered per token (the group's largest hi).
        seen: int, the group's smallest hi: keys ``[0, seen)`` are visible to every token of the group.
        mask: bool [G, 1, 1, S] visible keys (None: every token sees all S).
        hidden: bool [1, G, S - seen, 1, 1] keys past a token's hi, zeroed after the gather (None: none).
        empty: bool [G, 1, 1, 1] tokens that see no key (None: none).
    """

    tokens: torch.Tensor | None
    pages: int
    rows: torch.Tensor
    num_keys: int
    seen: int
    mask: torch.Tensor | None
    hidden: torch.Tensor | None
    empty: torch.Tensor | None


@dataclass(frozen=True)
class _BatchedPlan:
    """The step's groups and one gather buffer [max rows, page] the groups of every layer reuse."""

    groups: tuple[_Group, ...]
    buffer: torch.Tensor


def _batched_plan(
    kv_blocks: torch.Tensor, meta: PagedMetadata, options: AttentionOptions, dtype: torch.dtype
) -> _BatchedPlan:
    """`decode_batched`'s per-step plan (see there), built by the first layer and kept in ``meta.plans``."""
    kv_dim, page_size, num_kv_heads, head_dim = kv_blocks.shape[1], *kv_blocks.shape[3:6]
    itemsize = max(kv_blocks.element_size(), dtype.itemsize)  # FP8 pages are read as float32
    page_bytes = kv_dim * page_size * num_kv_heads * head_dim * itemsize
    key = ("decode_batched", tuple(kv_blocks.shape), kv_blocks.dtype, page_bytes, options.causal)
    plan: _BatchedPlan | None = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _build_batched_plan(kv_blocks, meta, options, page_bytes)
    return plan


def _build_batched_plan(
    kv_blocks: torch.Tensor, meta: PagedMetadata, options: AttentionOptions, page_bytes: int
) -> _BatchedPlan:
    """The groups of `decode_batched` (see there) and their gather buffer."""
    kv_dim, num_layers, page_size, num_kv_heads, head_dim = kv_blocks.shape[1:6]
    num_tokens = meta.num_tokens
    kv_len = meta.kv_lengths[meta.token_request]  # [T]
    hi = torch.minimum(options.key_ranges(meta.token_position, kv_len)[2], kv_len)  # [T]: keys [0, hi) are seen
    order = torch.argsort(hi, stable=True)  # [T]: fewest keys first, so groups pad little
    hi_sorted = hi[order].tolist()
    max_pages = meta.lookup_table.shape[1]
    pages_sorted = [min(-(-h // page_size), max_pages) for h in hi_sorted]
    base = meta.lookup_table * (kv_dim * num_layers)  # [B, C]: row of each page's K in layer 0; V is `L` further
    groups: list[_Group] = []
    start, most = 0, 0
    while start < num_tokens:
        end = start + 1  # grow the group while its padded gather fits (the last token reads the most pages)
        while end < num_tokens and (end + 1 - start) * pages_sorted[end] * page_bytes <= _BATCH_KV_BYTES:
            end += 1
        n, seen = pages_sorted[end - 1], max(0, hi_sorted[start])
        num_keys = min(hi_sorted[end - 1], n * page_size)
        tokens = order[start:end] if start or end < num_tokens else None  # [G] tokens (None: all, in order)
        start = end
        if n == 0:
            continue  # no token of the group sees a key: zeros
        sel = slice(None) if tokens is None else tokens
        ids = base[meta.token_request[sel], :n]  # [G, n]
        ids = ids if kv_dim == 1 else torch.stack((ids, ids + num_layers))  # [kv_dim, G, n]: K rows, then V rows
        visible = torch.arange(num_keys) < hi[sel][:, None]  # [G, S]
        mask = hidden = empty = None
        if seen < num_keys:  # keys past a token's hi (stale slots, padding) are masked and zeroed: not even NaN
            mask = visible[:, None, None]  # [G, 1, 1, S]
            hidden = ~visible[None, :, seen:, None, None]  # [1, G, S - seen, 1, 1]
        if seen <= 0:
            empty = (hi[sel] <= 0)[:, None, None, None]  # [G, 1, 1, 1]
        groups.append(_Group(tokens, n, ids.flatten(), num_keys, seen, mask, hidden, empty))
        most = max(most, ids.numel())
    return _BatchedPlan(tuple(groups), kv_blocks.new_empty((most, page_size * num_kv_heads * head_dim)))


def decode_batched(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float,
    kv_scales: torch.Tensor | None,
    options: AttentionOptions,
) -> torch.Tensor:
    """Decode attention of query [T, H_q, D], every token's pages gathered at once; returns [T, H_q, Dv].

    Tokens are sorted by how many keys they see and cut into groups whose padded K + V fit in
    ``_BATCH_KV_BYTES``; each group gathers its pages (K rows then V rows) with one `index_select` into
    ``[kv_dim, G, S, H_kv, D]`` (S: the group's most keys), zeroes the keys its tokens may not see (stale
    slots, padding: not even NaN gets in; without a window or chunk token t sees exactly keys ``[0, hi_t)``)
    and runs one SDPA over the group with the GQA group folded into the query axis, with a boolean key mask
    only when its tokens see different numbers of keys. The groups, their page rows and masks are planned
    once per step (`_batched_plan`), and every layer gathers into the same buffer (so one step's layers run
    one after the other, as a model runs them). Options as
    `batched_supported` says (the loop serves the rest).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    kv_dim, num_layers, page_size, num_kv_heads = kv_blocks.shape[1:5]
    dtype = _compute_dtype(query, kv_blocks, None)
    plan = _batched_plan(kv_blocks, meta, options, dtype)
    q = query.to(dtype).view(num_tokens, num_kv_heads, -1, head_dim)  # [T, H_kv, g, D]
    v_dim = options.v_head_dim or head_dim
    out = None  # [T, H_kv, g, Dv]; no visible key: zeros
    if len(plan.groups) != 1 or plan.groups[0].tokens is not None:
        out = torch.zeros((*q.shape[:3], v_dim), dtype=query.dtype)
    rows = kv_blocks.view(-1, page_size * num_kv_heads * head_dim)  # [(P + 1) * kv_dim * L, page]
    s_rows = None if kv_scales is None else kv_scales.view(-1, page_size * num_kv_heads * kv_scales.shape[-1])
    for group in plan.groups:
        ids = group.rows + layer  # [kv_dim * G * n]
        x = torch.index_select(rows, 0, ids, out=plan.buffer[: ids.shape[0]])  # [kv_dim * G * n, page]
        x = x.view(kv_dim, -1, group.pages * page_size, num_kv_heads, head_dim)  # [kv_dim, G, n * page, H_kv, D]
        if s_rows is not None:
            s = torch.index_select(s_rows, 0, ids).view(*x.shape[:4], -1)  # [kv_dim, G, S, H_kv, Gs]
            x = dequantize(x, s)  # float32
        x = x.to(dtype)[:, :, : group.num_keys]  # [kv_dim, G, S, H_kv, D]
        if group.hidden is not None:
            x[:, :, group.seen :].masked_fill_(group.hidden, 0.0)
        k, v = x[0].transpose(1, 2), x[-1].transpose(1, 2)  # [G, H_kv, S, D] each
        sel = slice(None) if group.tokens is None else group.tokens
        o = F.scaled_dot_product_attention(q[sel], k, v, attn_mask=group.mask, scale=scale)  # [G, H_kv, g, D]
        o = o[..., :v_dim]
        if group.empty is not None:
            o = o.masked_fill(group.empty, 0.0)  # [G, H_kv, g, Dv]
        if out is None:
            return o.to(query.dtype).reshape(num_tokens, num_q_heads, v_dim)
        out[sel] = o.to(query.dtype)
    assert out is not None
    return out.view(num_tokens, num_q_heads, v_dim)


def decode_loop(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention of each token of query [T, H_q, D] over its visible keys; returns [T, H_q, Dv] in query's dtype."""
    num_tokens, num_q_heads, head_dim = query.shape
    kv_dim, num_layers, page_size, num_kv_heads = kv_blocks.shape[1:5]
    dtype = _compute_dtype(query, kv_blocks, softcap)
    q = query.to(dtype).reshape(num_tokens, num_kv_heads, -1, head_dim)  # [T, H_kv, g, D]
    v_dim = options.v_head_dim or head_dim
    out = torch.zeros((*q.shape[:3], v_dim), dtype=query.dtype)  # [T, H_kv, g, Dv]; no visible key: zeros
    sinks = options.sink_logits(query.device)
    sink_lse = None if sinks is None else sinks.view(num_kv_heads, -1)  # [H_kv, g]
    ranges = _token_ranges(meta, options)
    requests = meta.token_request.tolist()
    slopes = options.alibi(query.device)  # float32 [H_q] or None
    head_slopes = None if slopes is None else slopes.view(num_kv_heads, -1, 1)  # [H_kv, g, 1]
    q_positions = meta.token_position.tolist() if slopes is not None else []
    spans = [-(-e // page_size) - s // page_size for token in ranges for s, e in token]
    itemsize = max(kv_blocks.element_size(), dtype.itemsize)  # FP8 pages are read as float32
    page_bytes = kv_dim * page_size * num_kv_heads * head_dim * itemsize
    chunk = min(max(1, _CHUNK_KV_BYTES // page_bytes), max(spans, default=1))  # pages per chunk
    rows = kv_blocks.view(-1, page_size * num_kv_heads * head_dim)  # [(P + 1) * kv_dim * L, page]
    k_rows = meta.lookup_table * (kv_dim * num_layers) + layer  # [B, C]: row of each page's K; V is `L` further
    buf = rows.new_empty((kv_dim * chunk, rows.shape[1]))  # [kv_dim * chunk, page]
    s_rows = s_buf = None
    if kv_scales is not None:
        s_rows = kv_scales.view(-1, page_size * num_kv_heads * kv_scales.shape[-1])  # like `rows`
        s_buf = s_rows.new_empty((kv_dim * chunk, s_rows.shape[1]))
    for t in range(num_tokens):
        q_t, parts = q[t : t + 1], []  # q_t [1, H_kv, g, D]
        for start, end in ranges[t]:
            first = start // page_size
            pages = k_rows[requests[t], first : -(-end // page_size)]  # [n]
            for c0 in range(0, pages.shape[0], chunk):
                ids = pages[c0 : c0 + chunk]  # [m]
                ids = ids if kv_dim == 1 else torch.cat((ids, ids + num_layers))  # [kv_dim * m]: K rows, then V rows
                x = torch.index_select(rows, 0, ids, out=buf[: ids.shape[0]])  # [kv_dim * m, page]
                x = x.view(kv_dim, -1, num_kv_heads, head_dim)  # [kv_dim, m * page_size, H_kv, D]
                if s_rows is not None and s_buf is not None:
                    s = torch.index_select(s_rows, 0, ids, out=s_buf[: ids.shape[0]])  # [kv_dim * m, page of scales]
                    x = dequantize(x, s.view(kv_dim, x.shape[1], num_kv_heads, -1))  # float32
                base = (first + c0) * page_size  # position of x[:, 0]
                x = x[:, max(start - base, 0) : end - base].to(dtype)  # [kv_dim, S_c, H_kv, D]
                bias = None
                if head_slopes is not None:  # slope * (key position - query position)
                    k_pos = torch.arange(x.shape[1]) + (max(start, base) - q_positions[t])  # [S_c]
                    bias = head_slopes * k_pos.float()  # [H_kv, g, S_c]
                parts.append(_attend_chunk(q_t, x[0], x[-1], scale, softcap, bias))
        if parts and sink_lse is not None:
            parts.append((torch.zeros(parts[0][0].shape), sink_lse))  # the sink: probability mass, no value
        if parts:
            out[t] = (parts[0][0] if len(parts) == 1 else _merge(parts))[..., :v_dim]
    return out.view(num_tokens, num_q_heads, v_dim)


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H_kv, g, D] over every key of k, v [S, H_kv, D]: (output [H_kv, g, D], float32 logsumexp [H_kv, g]).

    `bias` float32 [H_kv, g, S] (ALiBi) is added to the logits after the softcap.
    """
    if softcap is None and bias is None and _FLASH is not None:
        o, lse = _FLASH(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)  # [1, H_kv, g, D]
        return o[0], lse[0]
    logits = torch.matmul(q[0].float(), k.float().permute(1, 2, 0)) * scale  # [H_kv, g, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if bias is not None:
        logits = logits + bias  # [H_kv, g, S]
    o = torch.matmul(torch.softmax(logits, dim=-1), v.float().transpose(0, 1))  # [H_kv, g, D]
    return o, torch.logsumexp(logits, dim=-1)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine chunk outputs [H_kv, g, D] by their logsumexps [H_kv, g] (float32)."""
    weights = torch.softmax(torch.stack([lse.float() for _, lse in parts]), dim=0)  # [C, H_kv, g]
    outs = torch.stack([o.float() for o, _ in parts])  # [C, H_kv, g, D]
    return (outs * weights.unsqueeze(-1)).sum(dim=0)  # [H_kv, g, D]
