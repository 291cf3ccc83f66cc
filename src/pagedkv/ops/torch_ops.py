"""Vectorised torch paged KV ops, tested against `pagedkv.ops.reference`.

Shapes: ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]`` (kv 0 = K, kv
``kv_dim - 1`` = V, so MLA's single slot serves both); ``key/value/query
[T, ..., D]`` ragged over the batch's requests as described by `PagedMetadata`.

`store_kv` (`pagedkv.ops.torch_store`) writes every token with one
advanced-index assignment per K/V. `paged_attention` takes one of two paths:

* CPU decode (every request has one new token; `pagedkv.ops.torch_decode`): a
  loop over tokens that gathers only the keys the token's mask lets it see, in
  chunks merged by logsumexp, so a sliding window bounds the cost.
* everything else (prefill chunks, mixed batches, any device;
  `pagedkv.ops.torch_padded`): requests padded to the batch's longest query and
  key windows attend in float32 under a boolean mask.

The masking options (sliding window, chunked attention, sink tokens, learned
sinks, MLA value width, cross-attention) are described in `pagedkv.ops.masks`.
"""

from __future__ import annotations

import math

import torch

from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.torch_decode import decode_loop as _decode_loop
from pagedkv.ops.torch_padded import padded_attention as _padded_attention
from pagedkv.ops.torch_store import dequantize, quantize, store_kv

__all__ = ["store_kv", "paged_attention", "quantize", "dequantize"]

_LOOP_MIN_KEYS = 48  # CPU decode: below about this many keys per token the padded path is as fast


def paged_attention(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float | None,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    *,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sink_tokens: int = 0,
    sinks: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of query [T, H_q, D] over the paged K/V of `layer`; returns [T, H_q, Dv] in query's dtype.

    By default token t attends positions ``0..meta.token_position[t]`` of its
    request; the keyword options restrict or change that as `pagedkv.ops.masks`
    describes (``causal`` must match the metadata's). GQA: query head h reads
    KV head ``h // (H_q // H_kv)``. Logits are ``q.k * scale`` (default
    1/sqrt(D)), soft-capped as ``softcap * tanh(x / softcap)`` if given;
    accumulation is float32 (fp16/bf16 through SDPA's float32 accumulators).
    Dv is `v_head_dim` (default D). Matches `paged_attention_reference`.
    Raises ValueError on a shape mismatch or an invalid option.
    """
    options = AttentionOptions(sliding_window, chunk_size, sink_tokens, sinks, v_head_dim, causal)
    num_tokens, num_q_heads, head_dim = _check_query(query, kv_blocks, meta)
    options.check(num_q_heads, head_dim)
    if meta.causal != causal:
        raise ValueError(f"causal={causal} but the metadata was built with causal={meta.causal}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if num_tokens == 0:
        return query.new_empty((0, num_q_heads, v_head_dim or head_dim))
    max_q, max_kv = _max_lengths(meta)
    if max_kv == 0:  # cross-attention over empty caches: nothing to see
        return query.new_zeros((num_tokens, num_q_heads, v_head_dim or head_dim))
    contiguous = kv_blocks.is_contiguous() and (kv_scales is None or kv_scales.is_contiguous())
    if query.device.type == "cpu" and max_q == 1 and max_kv >= _LOOP_MIN_KEYS and contiguous:
        return _decode_loop(query, kv_blocks, meta, layer, scale, softcap, kv_scales, options)
    return _padded_attention(query, kv_blocks, meta, layer, scale, softcap, kv_scales, options, max_q, max_kv)


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
