"""The step's page table in the formats of other attention kernels (FlashInfer, vLLM).

pagedkv describes a ragged batch by ``lookup_table [B, C]`` (null-padded page
ids), ``cache_lengths [B]`` and ``input_row_offsets [B + 1]``: token i of
request b sits at position ``cache_lengths[b] + i``, in page
``lookup_table[b, pos // page_size]`` at slot ``pos % page_size``. Request b's
keys are its first ``kv_len[b] = cache_lengths[b] + q_len[b]`` positions.

* FlashInfer (``BatchDecodeWithPagedKVCacheWrapper.plan`` / the prefill wrapper):
  ``kv_indptr int32 [B + 1]``, ``kv_indices int32 [sum of pages]``,
  ``kv_last_page_len int32 [B]``; request b owns
  ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, ``ceil(kv_len / page_size)``
  pages whose last holds ``(kv_len - 1) % page_size + 1`` tokens (0 pages and
  a last length of 0 for an empty request). ``qo_indptr`` is `input_row_offsets`.
* vLLM (``PagedAttention`` / FlashAttention backends): ``block_table int32
  [B, max_pages]`` null-padded past each request's pages, and ``slot_mapping
  int64 [T] = page * page_size + slot`` of every new token. ``seq_lens`` is kv_len.

Only the page ids are translated; the page memory layout differs between
libraries (pagedkv pages hold every layer's K and V).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["FlashInferPageTable", "VLLMPageTable", "flashinfer_page_table", "vllm_page_table"]


class FlashInferPageTable(NamedTuple):
    """FlashInfer's paged-KV description of a batch (all int32, on the cache's device)."""

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B]


class VLLMPageTable(NamedTuple):
    """vLLM's paged-KV description of a batch (on the cache's device)."""

    block_table: torch.Tensor  # int32 [B, max_pages]
    slot_mapping: torch.Tensor  # int64 [T]


def _metadata(source: RaggedKVCacheInputs | PagedMetadata, input_row_offsets: torch.Tensor | None) -> PagedMetadata:
    if isinstance(source, PagedMetadata):
        if input_row_offsets is not None:
            raise ValueError("pass input_row_offsets=None with a PagedMetadata: it already holds them")
        return source
    if not isinstance(source, RaggedKVCacheInputs):
        raise TypeError(f"source must be RaggedKVCacheInputs or PagedMetadata, got {type(source).__name__}")
    if input_row_offsets is None:
        raise ValueError("input_row_offsets [B + 1] is needed with RaggedKVCacheInputs")
    return PagedMetadata.build(source, input_row_offsets)


def _pages_per_request(meta: PagedMetadata) -> torch.Tensor:
    """int64 [B]: pages covering each request's kv_len keys."""
    return torch.div(meta.kv_lengths + meta.page_size - 1, meta.page_size, rounding_mode="floor")


def flashinfer_page_table(
    source: RaggedKVCacheInputs | PagedMetadata, input_row_offsets: torch.Tensor | None = None
) -> FlashInferPageTable:
    """FlashInfer's (kv_indptr [B + 1], kv_indices [sum pages], kv_last_page_len [B]), all int32.

    `source` is the step's `RaggedKVCacheInputs` with its `input_row_offsets`
    (int [B + 1]), or a `PagedMetadata` already built from them (then pass no
    offsets). Sizing `kv_indices` reads the page count on the host (a device
    sync on CUDA). Raises ValueError/TypeError on a bad argument.
    """
    meta = _metadata(source, input_row_offsets)
    pages = _pages_per_request(meta)  # [B]
    kv_indptr = torch.zeros(meta.num_requests + 1, dtype=torch.int64, device=pages.device)
    torch.cumsum(pages, 0, out=kv_indptr[1:])  # [B + 1]
    columns = torch.arange(meta.lookup_table.shape[1], device=pages.device)  # [C]
    kv_indices = meta.lookup_table[columns < pages[:, None]]  # [sum pages], row-major = request order
    last = torch.where(meta.kv_lengths > 0, (meta.kv_lengths - 1) % meta.page_size + 1, 0)  # [B]
    return FlashInferPageTable(kv_indptr.to(torch.int32), kv_indices.to(torch.int32), last.to(torch.int32))


def vllm_page_table(
    source: RaggedKVCacheInputs | PagedMetadata,
    input_row_offsets: torch.Tensor | None = None,
    *,
    null_page: int | None = None,
) -> VLLMPageTable:
    """vLLM's (block_table int32 [B, max_pages], slot_mapping int64 [T]).

    `source` as for `flashinfer_page_table`. ``max_pages`` covers the longest
    request (from the metadata's host-side max length: no device sync); columns
    past a request's pages hold `null_page`, which defaults to the cache's null
    page (``blocks.shape[0] - 1``) and must be given with a `PagedMetadata`.
    """
    meta = _metadata(source, input_row_offsets)
    if null_page is None:
        if not isinstance(source, RaggedKVCacheInputs):
            raise ValueError("null_page is needed with a PagedMetadata (it does not know the page count)")
        null_page = source.blocks.shape[0] - 1
    max_kv = meta.max_kv_len
    if meta.kv_lengths.device.type == "cpu" and meta.num_requests:  # exact, and free on the host
        max_kv = int(meta.kv_lengths.max())
    max_pages = min(-(-max_kv // meta.page_size), meta.lookup_table.shape[1])
    columns = torch.arange(max_pages, device=meta.lookup_table.device)  # [max_pages]
    held = columns < _pages_per_request(meta)[:, None]  # [B, max_pages]
    block_table = torch.where(held, meta.lookup_table[:, :max_pages], null_page)  # [B, max_pages]
    slot_mapping = meta.slot_page * meta.page_size + meta.slot_offset  # [T]
    return VLLMPageTable(block_table.to(torch.int32), slot_mapping)
