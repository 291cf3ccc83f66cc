"""How close the Triton paged decode comes to the GPU's memory bandwidth (CUDA only).

A decode step reads every cached K/V byte of the batch once and does little
math per byte, so its speed limit is HBM bandwidth. `run_triton_bench` times
`pagedkv.ops.triton_decode.paged_decode` and reports its achieved bandwidth
(the K/V page bytes, plus FP8 scales, that the call must read, over its time)
as a fraction of the bandwidth of a large device-to-device copy timed in the
same run (a copy reads and writes every byte: ``2 * bytes / time``).

Default shape: batch 32, context 2048 (the query attends 2048 positions),
8 KV heads with 32 query heads (GQA 4), head_dim 128, bfloat16, page size
16, pages in shuffled order as a long-running pool leaves them. The K/V read
per call (256 MiB) is far larger than the L2 cache, so every call streams
from HBM. Timing: CUDA events around `inner` back-to-back calls, after
`warmup` calls, best of `repeats`. The output is first checked against a
dense torch computation of the same attention.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.bench import report
from pagedkv.bench.timing import best_of_cuda
from pagedkv.ops import triton_decode
from pagedkv.ops.fp8 import quantize_reference
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

__all__ = [
    "add_arguments",
    "bench_batch",
    "command",
    "decode_bytes_read",
    "dense_decode",
    "format_report",
    "run_triton_bench",
]


def decode_bytes_read(
    kv_lengths: Sequence[int],
    n_kv_heads: int,
    head_dim: int,
    kv_dim: int,
    elem_bytes: int,
    num_scale_groups: int = 0,
    scale_bytes: int = 0,
) -> int:
    """Bytes of pages one decode call must read: each attended position's K and V (kv_dim of them,
    1 for MLA's shared latent) for every KV head, D elements plus G scales each.

    Query, output, lookup table and split partials are left out (well under 1% at the bench's shape).
    """
    per_position = kv_dim * n_kv_heads * (head_dim * elem_bytes + num_scale_groups * scale_bytes)
    return sum(kv_lengths) * per_position


def dense_decode(
    query: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None, lut: torch.Tensor, context: int
) -> torch.Tensor:
    """The same attention from gathered pages, in float32 torch ops (every request attends `context` positions)."""
    batch, num_q_heads, head_dim = query.shape
    page_size, num_kv_heads = blocks.shape[3], blocks.shape[4]
    pages = lut[:, : math.ceil(context / page_size)].long()  # [B, n]
    kv = blocks[pages, :, 0].float()  # [B, n, kv_dim, page, H_kv, D] (layer 0)
    if scales is not None:
        s = scales[pages, :, 0].float()  # [B, n, kv_dim, page, H_kv, G]
        kv = (kv.unflatten(-1, (s.shape[-1], -1)) * s.unsqueeze(-1)).flatten(-2)
    kv = kv.transpose(2, 1).flatten(2, 3)[:, :, :context]  # [B, kv_dim, S, H_kv, D]
    keys, values = kv[:, 0], kv[:, -1]  # [B, S, H_kv, D]
    group = num_q_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, head_dim)  # [B, H_kv, g, D]
    logits = torch.einsum("bhgd,bshd->bhgs", q, keys) / math.sqrt(head_dim)  # [B, H_kv, g, S]
    out = torch.einsum("bhgs,bshd->bhgd", logits.softmax(-1), values)  # [B, H_kv, g, D]
    return out.reshape(batch, num_q_heads, head_dim)


def bench_batch(
    batch: int,
    context: int,
    n_kv_heads: int,
    n_q_heads: int,
    head_dim: int,
    page_size: int,
    dtype: str,
    fp8_granularity: int | None,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, RaggedKVCacheInputs, PagedMetadata]:
    """(query [B, H_q, D], inputs, metadata) of a decode step where every request attends `context` positions.

    Pages are shuffled; K/V are random. An FP8 `dtype` quantizes them with
    float32 scales every `fp8_granularity` elements (default head_dim), and the query is bfloat16.
    """  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    cache_dtype = getattr(torch, dtype)
    query_dtype = torch.bfloat16 if cache_dtype.itemsize == 1 else cache_dtype
    pages_per_request = math.ceil(context / page_size)
    num_pages = batch * pages_per_request
    shape = (num_pages + 1, 2, 1, page_size, n_kv_heads, head_dim)  # [P + 1, kv_dim, L, page, H_kv, D]
    blocks = torch.randn(shape, generator=gen, device=device, dtype=query_dtype)
    scales = None
    if cache_dtype.itemsize == 1:
        groups = head_dim // (fp8_granularity or head_dim)
        q, s = quantize_reference(blocks.view(-1, head_dim), groups, cache_dtype)  # [N, D], [N, G]
        blocks, scales = q.view(shape), s.view(*shape[:5], groups)  # scales: [P + 1, kv_dim, L, page, H_kv, G]
    lut = torch.randperm(num_pages, generator=gen, device=device).view(batch, pages_per_request)  # [B, C]
    inputs = RaggedKVCacheInputs(
        blocks, torch.full((batch,), context - 1, dtype=torch.int32, device=device), lut.to(torch.int32),
        max_lengths_table(1, context), scales,
    )  # fmt: skip
    meta = PagedMetadata.build(inputs, torch.arange(batch + 1, device=device), batch)  # one query token each
    query = torch.randn((batch, n_q_heads, head_dim), generator=gen, device=device, dtype=query_dtype)  # [B, H_q, D]
    return query, inputs, meta


def run_triton_bench(
    batch: int = 32,
    context: int = 2048,
    n_kv_heads: int = 8,
    n_q_heads: int = 32,
    head_dim: int = 128,
    page_size: int = 16,
    dtype: str = "bfloat16",
    fp8_granularity: int | None = None,
    copy_mib: int = 1024,
    warmup: int = 10,
    repeats: int = 20,
    inner: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure the kernel's achieved bandwidth against a device copy's; returns a flat dict of figures.

    `dtype` is the cache dtype ("bfloat16", "float16", or "float8_e4m3fn" with
    float32 scales every `fp8_granularity` elements; see `bench_batch`).
    Raises RuntimeError without CUDA or when the kernel is not usable (no
    triton, or its self-check failed), and when its output does not match the
    dense computation.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the Triton decode bench needs a CUDA GPU; torch.cuda.is_available() is False")
    if not triton_decode.available():
        raise RuntimeError("the Triton decode kernel is not usable here (triton missing or its self-check failed)")
    device = torch.device("cuda", torch.cuda.current_device())
    query, inputs, meta = bench_batch(
        batch, context, n_kv_heads, n_q_heads, head_dim, page_size, dtype, fp8_granularity, device, seed
    )  # fmt: skip
    blocks, scales = inputs.blocks, inputs.kv_scales

    def decode() -> torch.Tensor:
        return triton_decode.paged_decode(query, blocks, meta, 0, None, None, scales)  # [B, H_q, D]

    got, expected = decode().float(), dense_decode(query, blocks, scales, inputs.lookup_table, context)
    max_err = float((got - expected).abs().max())
    if not torch.allclose(got, expected, atol=2e-3, rtol=1.6e-2):
        raise RuntimeError(f"Triton decode output differs from the dense computation (max |error| {max_err:.3g})")
    del got, expected

    kernel_ms = best_of_cuda(decode, warmup, repeats, inner)
    num_groups, scale_bytes = (0, 0) if scales is None else (scales.shape[-1], scales.element_size())
    nbytes = decode_bytes_read(
        [context] * batch, n_kv_heads, head_dim, 2, blocks.element_size(), num_groups, scale_bytes
    )  # fmt: skip
    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = best_of_cuda(lambda: dst.copy_(src), warmup, repeats, inner)
    kernel_gbps = nbytes / (kernel_ms * 1e-3) / 1e9
    copy_gbps = 2 * src.numel() / (copy_ms * 1e-3) / 1e9
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = triton_decode.decode_config(batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim, context, sms, None)
    return {
        "device": torch.cuda.get_device_name(device), "batch": batch, "context": context,
        "n_kv_heads": n_kv_heads, "n_q_heads": n_q_heads, "head_dim": head_dim, "page_size": page_size,
        "dtype": dtype, "num_splits": cfg.num_splits, "bytes_per_call": nbytes, "kernel_us": kernel_ms * 1e3,
        "kernel_gbps": kernel_gbps, "copy_gbps": copy_gbps, "fraction_of_copy": kernel_gbps / copy_gbps,
        "max_abs_err": max_err,
    }  # fmt: skip


def format_report(result: dict[str, Any]) -> str:
    """One line: the kernel's bandwidth and its fraction of the copy bandwidth."""
    return (
        f"triton paged decode on {result['device']}: B={result['batch']} ctx={result['context']} "
        f"H_kv={result['n_kv_heads']} H_q={result['n_q_heads']} D={result['head_dim']} {result['dtype']} "
        f"page={result['page_size']} splits={result['num_splits']}: {result['kernel_us']:.1f} us, "
        f"{result['kernel_gbps']:.0f} GB/s = {100 * result['fraction_of_copy']:.1f}% of copy "
        f"({result['copy_gbps']:.0f} GB/s)"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `pagedkv bench triton` (one line of figures: no table, no plots)."""
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"],
                   help="cache dtype (float8_e4m3fn: float32 scales every head_dim elements)")  # fmt: skip


def command(args: argparse.Namespace) -> int:
    """`pagedkv bench triton`: measure, print the line, write --json; 2 without a usable CUDA kernel."""
    try:
        result = run_triton_bench(dtype=args.dtype)
    except RuntimeError as exc:  # no CUDA GPU (or no usable kernel) here
        print(f"pagedkv bench triton: {exc}", file=sys.stderr)
        return 2
    report.finish(args, format_report(result), result)
    return 0
