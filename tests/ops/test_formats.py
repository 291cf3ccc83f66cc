"""Page tables exported in FlashInfer's and vLLM's formats describe the same (request, position) -> slot map."""

from __future__ import annotations

import pytest
import torch
from test_ops import make_manager, ragged_steps

from pagedkv.ops.formats import FlashInferPageTable, VLLMPageTable, flashinfer_page_table, vllm_page_table
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

Slots = dict[tuple[int, int], tuple[int, int]]  # (request, position) -> (page, slot)


def lookup_map(inputs: RaggedKVCacheInputs, offsets: torch.Tensor) -> Slots:
    """The truth: every key position of every request, straight from the lookup table."""
    ps = inputs.blocks.shape[3]
    q_lens = (offsets[1:] - offsets[:-1]).tolist()
    out = {}
    for b, (cached, q_len) in enumerate(zip(inputs.cache_lengths.tolist(), q_lens, strict=True)):
        for pos in range(cached + q_len):
            out[b, pos] = (int(inputs.lookup_table[b, pos // ps]), pos % ps)
    return out


def flashinfer_map(table: FlashInferPageTable, page_size: int) -> Slots:
    indptr, indices, last = (t.tolist() for t in table)
    out = {}
    for b in range(len(last)):
        pages = indices[indptr[b] : indptr[b + 1]]
        assert (last[b] == 0) == (not pages) and 0 <= last[b] <= page_size
        for pos in range((len(pages) - 1) * page_size + last[b] if pages else 0):
            out[b, pos] = (pages[pos // page_size], pos % page_size)
    return out


def vllm_map(table: VLLMPageTable, seq_lens: list[int], page_size: int, null: int) -> Slots:
    out = {}
    for b, row in enumerate(table.block_table.tolist()):
        held = -(-seq_lens[b] // page_size)
        assert all(p == null for p in row[held:]), f"request {b}: padding is not the null page"
        assert null not in row[:held]
        for pos in range(seq_lens[b]):
            out[b, pos] = (row[pos // page_size], pos % page_size)
    return out


def check_formats(inputs: RaggedKVCacheInputs, offsets: torch.Tensor) -> None:
    ps, null = inputs.blocks.shape[3], inputs.blocks.shape[0] - 1
    truth = lookup_map(inputs, offsets)
    meta = PagedMetadata.build(inputs, offsets)
    seq_lens = meta.kv_lengths.tolist()
    for fi in (flashinfer_page_table(inputs, offsets), flashinfer_page_table(meta)):
        assert [t.dtype for t in fi] == [torch.int32] * 3 and fi.kv_indptr.shape == (len(seq_lens) + 1,)
        assert flashinfer_map(fi, ps) == truth
    for vt in (vllm_page_table(inputs, offsets), vllm_page_table(meta, null_page=null)):
        assert vt.block_table.dtype == torch.int32 and vt.slot_mapping.dtype == torch.int64
        assert vt.block_table.shape == (len(seq_lens), -(-max(seq_lens, default=0) // ps))
        assert vllm_map(vt, seq_lens, ps, null) == truth
        # each new token's slot: request b's token i is at position cache_lengths[b] + i
        tokens = [(b, c + i) for b, c in enumerate(inputs.cache_lengths.tolist())
                  for i in range(int(offsets[b + 1] - offsets[b]))]  # fmt: skip
        assert [divmod(s, ps) for s in vt.slot_mapping.tolist()] == [truth[t] for t in tokens]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_formats_on_manager_batches(page_size: int) -> None:
    for step in ragged_steps(make_manager(page_size), 1):  # prefix hits, chunked prefill, decode
        check_formats(step.inputs, step.offsets)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_formats_on_random_ragged_batches(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    for _ in range(20):
        batch = int(torch.randint(1, 7, (1,), generator=gen))
        cached = torch.randint(0, 40, (batch,), generator=gen)
        q_lens = torch.randint(0, 9, (batch,), generator=gen)
        q_lens[0] = max(1, int(q_lens[0]))
        cached[-1] = 0 if batch > 1 else cached[-1]
        q_lens[-1] = 0 if batch > 1 else q_lens[-1]  # an empty request: no pages, last page length 0
        kv_lens = cached + q_lens
        cols = -(-int(kv_lens.max()) // page_size) + 3
        num_pages = batch * cols
        lut = torch.full((batch, cols), num_pages, dtype=torch.int32)  # null-padded
        ids = torch.randperm(num_pages, generator=gen).to(torch.int32)
        for b in range(batch):
            n = -(-int(kv_lens[b]) // page_size)
            lut[b, :n] = ids[b * cols : b * cols + n]
        blocks = torch.empty(num_pages + 1, 2, 1, page_size, 1, 1)
        inputs = RaggedKVCacheInputs(blocks, cached.to(torch.int32), lut,
                                     max_lengths_table(int(q_lens.max()), int(kv_lens.max())))  # fmt: skip
        check_formats(inputs, torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]))


def test_format_argument_errors() -> None:
    step = next(ragged_steps(make_manager(3), 1))
    meta = PagedMetadata.build(step.inputs, step.offsets)
    with pytest.raises(ValueError, match=r"input_row_offsets \[B \+ 1\] is needed"):
        flashinfer_page_table(step.inputs)
    with pytest.raises(ValueError, match="pass input_row_offsets=None with a PagedMetadata"):
        vllm_page_table(meta, step.offsets)
    with pytest.raises(ValueError, match="null_page is needed with a PagedMetadata"):
        vllm_page_table(meta)
    with pytest.raises(TypeError, match="source must be RaggedKVCacheInputs or PagedMetadata, got dict"):
        flashinfer_page_table({}, step.offsets)  # type: ignore[arg-type]
