"""The Triton decode bandwidth bench: byte accounting and its dense correctness check (CPU-checkable parts)."""

from __future__ import annotations

import pytest
import torch
from test_triton_decode import Case, decode_batch

from pagedkv.ops import reference


def test_bench_byte_accounting() -> None:
    from pagedkv.bench.triton_bench import decode_bytes_read

    # The bench's shape: 32 requests x 2048 positions x (K + V) x 8 heads x 128 bf16 = 256 MiB.
    assert decode_bytes_read([2048] * 32, 8, 128, 2, 2) == 256 << 20
    # The bytes of the pages a decode batch reads, when its lengths fill whole pages.
    case = Case("float8_e4m3fn", "float32", 4, 2, 1, 32, (7, 11), granularity=8)  # kv lengths 8 and 12
    inputs, _, _ = decode_batch(case, "cpu")
    assert inputs.kv_scales is not None
    pages = torch.cat([inputs.lookup_table[0, :2], inputs.lookup_table[1, :3]]).long()  # [5]
    read = inputs.blocks[pages, :, 1].nbytes + inputs.kv_scales[pages, :, 1].nbytes  # layer 1 of the 5 pages
    assert decode_bytes_read([8, 12], 2, 32, 2, 1, 4, 4) == read == 20 * 2 * 2 * (32 + 4 * 4)
    assert decode_bytes_read([8, 12], 1, 576, 1, 2) == 20 * 576 * 2  # MLA: one latent per position


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_bench_dense_check_matches_reference(dtype: str) -> None:
    from pagedkv.bench.triton_bench import bench_batch, dense_decode

    query, inputs, meta = bench_batch(3, 37, 2, 8, 32, 16, dtype, 16, torch.device("cpu"))
    offsets = torch.arange(4)  # [B + 1]
    assert meta.kv_lengths.tolist() == [37] * 3 and meta.max_kv_len == 37
    expected = reference.paged_attention_reference(
        query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, offsets, 0, None, None, inputs.kv_scales
    )  # [B, H_q, D]
    got = dense_decode(query, inputs.blocks, inputs.kv_scales, inputs.lookup_table, 37)  # [B, H_q, D]
    torch.testing.assert_close(got.to(query.dtype).float(), expected.float(), atol=2e-3, rtol=1.6e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_bench_needs_cuda() -> None:
    from pagedkv.bench.triton_bench import run_triton_bench

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        run_triton_bench()
