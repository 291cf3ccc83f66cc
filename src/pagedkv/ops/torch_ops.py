"""Vectorised torch paged KV ops, tested against `pagedkv.ops.reference`.

Shapes: ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]`` (kv 0 = K, kv
``kv_dim - 1`` = V, so MLA's single slot serves both); ``key/value/query
[T, ..., D]`` ragged over the batch's requests as described by `PagedMetadata`.

`store_kv` (`pagedkv.ops.torch_store`) writes every token with one
advanced-index assignment per K/V. `paged_attention` takes one of two paths:

* CPU decode (every request has one new token; `pagedkv.ops.torch_decode`):
  full attention gathers every token's pages at once, padded, and runs one
  masked SDPA per group of tokens (`decode_batched`); windows, chunks, softcap,
  learned sinks and ALiBi take a loop over tokens that gathers only the keys the token's mask lets it see, in
  chunks merged by logsumexp, so a sliding window bounds the cost.
* prefill of requests with no cached prefix, when the caller passes the step's K/V
  (`pagedkv.ops.torch_fresh`): causal SDPA over those, in the model's dtype, other requests as below;
* everything else (prefill chunks, mixed batches, any device;
  `pagedkv.ops.torch_padded`): requests padded to the batch's longest query and
  key windows attend in float32 under a boolean mask.

The masking options (sliding window, chunked attention, sink tokens, learned
sinks, MLA value width, cross-attention) are described in `pagedkv.ops.masks`.
"""

from __future__ import annotations

import math

import torch

from pagedkv.ops import torch_fresh
from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.torch_decode import batched_supported as _batched_supported
from pagedkv.ops.torch_decode import decode_batched as _decode_batched
from pagedkv.ops.torch_decode import decode_loop as _decode_loop
from pagedkv.ops.torch_padded import padded_attention as _padded_attention
from pagedkv.ops.torch_store import dequantize, quantize, store_kv

__all__ = ["store_kv", "paged_attention", "quantize", "dequantize"]

_FRESH = True  # prefill of requests with no cached prefix over the step's own K/V (tests turn it off)
_DECODE_BATCHED = True  # CPU decode with full attention: every page of the batch gathered at once (tests turn it off)
_LOOP_MIN_KEYS = 48  # CPU decode: below about this many keys per token the padded path is as fast
_PLAIN = AttentionOptions()  # plain causal attention


def paged_attention(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float | None,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    options: AttentionOptions | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [T, H_q, D] over the paged K/V of `layer`; returns [T, H_q, Dv] in query's dtype.

    By default token t attends positions ``0..meta.token_position[t]`` of its
    request; `options` restrict or change that as `pagedkv.ops.masks`
    describes (``options.causal`` matches the metadata's). GQA: query head h reads
    KV head ``h // (H_q // H_kv)``. Logits are ``q.k * scale`` (default
    1/sqrt(D)), soft-capped as ``softcap * tanh(x / softcap)`` if given;
    accumulation is float32 (fp16/bf16 through SDPA's float32 accumulators).
    Dv is ``options.v_head_dim`` (default D). Matches `paged_attention_reference`.
    The arguments were checked by the caller (`pagedkv.ops.paged_attention` or `pagedkv.ops.PagedStep`).
    `key` / `value` [T, H_kv, D]: the step's K/V of `layer` exactly as stored (optional); with them, requests
    with no cached prefix may attend over those instead of their pages (`pagedkv.ops.torch_fresh`).
    """
    options = options or _PLAIN
    num_tokens, num_q_heads, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if num_tokens == 0:
        return query.new_empty((0, num_q_heads, options.v_head_dim or head_dim))
    max_q, max_kv = _max_lengths(meta)
    if max_kv == 0:  # cross-attention over empty caches: nothing to see
        return query.new_zeros((num_tokens, num_q_heads, options.v_head_dim or head_dim))
    if _FRESH and max_q > 1 and torch_fresh.usable(query, key, value, kv_blocks, meta, softcap, kv_scales, options):
        fresh = torch_fresh.plan(meta)
        if fresh is not None and key is not None and value is not None:

            def general(q: torch.Tensor, m: PagedMetadata) -> torch.Tensor:  # the other requests: [T', H_q, D]
                return paged_attention(q, kv_blocks, m, layer, scale, softcap, kv_scales, options)

            return torch_fresh.fresh_attention(query, key, value, fresh, scale, general)
    contiguous = kv_blocks.is_contiguous() and (kv_scales is None or kv_scales.is_contiguous())
    cpu_decode = query.device.type == "cpu" and max_q == 1 and contiguous
    if cpu_decode and _DECODE_BATCHED and _batched_supported(softcap, options):
        return _decode_batched(query, kv_blocks, meta, layer, scale, kv_scales, options)
    if cpu_decode and max_kv >= _LOOP_MIN_KEYS:
        return _decode_loop(query, kv_blocks, meta, layer, scale, softcap, kv_scales, options)
    return _padded_attention(query, kv_blocks, meta, layer, scale, softcap, kv_scales, options, max_q, max_kv)


def _max_lengths(meta: PagedMetadata) -> tuple[int, int]:
    """(longest query window, longest key window): exact on CPU (computed once per step, kept in
    ``meta.plans``), the metadata's host ints elsewhere."""
    if meta.cache_lengths.device.type != "cpu" or meta.num_requests == 0:
        return meta.max_q_len, meta.max_kv_len
    lengths: tuple[int, int] | None = meta.plans.get(("max_lengths",))
    if lengths is None:
        q_lens = meta.input_row_offsets[1:] - meta.input_row_offsets[:-1]  # [B]
        lengths = meta.plans[("max_lengths",)] = (int(q_lens.max()), int(meta.kv_lengths.max()))
    return lengths
