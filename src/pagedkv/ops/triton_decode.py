"""Triton paged decode: one query token per request against its paged K/V, on CUDA.

`paged_decode` is a split-K (flash-decoding) kernel; the kernels live in
`pagedkv.ops._triton_decode_kernels`, imported on first use, so importing this
module needs neither triton nor a GPU. `available()` says whether the
dispatcher may pick it: triton imports, CUDA is there, and a one-time
self-check against `pagedkv.ops.reference` passes. Under ``TRITON_INTERPRET=1``
(set before the first call) the kernels run on CPU tensors, which is how the
tests check them without a GPU.

Shapes: ``query [B, H_q, D]`` (T == B: one token per request, at position
``cache_lengths[b]``); ``kv_blocks [P + 1, kv_dim, L, page_size, H_kv, D]``;
``kv_scales [P + 1, kv_dim, L, page_size, H_kv, G]`` for FP8 pages.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from pagedkv.ops.metadata import PagedMetadata

__all__ = ["available", "paged_decode", "DecodeConfig", "decode_config"]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz})
# FP8 dtype -> (shift, multiplier) that turn its byte into the float16 of the same value (`_load_kv` in the
# kernels). Not e5m2fnuz: its top exponent would land on float16's inf/NaN; it is AMD's, converted natively.
_FP8_BITS = {torch.float8_e4m3fn: (7, 256.0), torch.float8_e4m3fnuz: (7, 128.0), torch.float8_e5m2: (8, 1.0)}
_MAX_FOLDED_GROUPS = 8  # FP8 scale groups folded into the dots (one dot each); more are gathered per element
_SELF_CHECK_ATOL = 2e-3
_SELF_CHECK_RTOL = 1.6e-2  # one bfloat16 ulp: the kernel and the reference round the same float32 apart
_available: bool | None = None


@functools.cache
def _kernels() -> ModuleType:
    from pagedkv.ops import _triton_decode_kernels

    return _triton_decode_kernels


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and split count of one launch.

    block_h: query heads per program (a power of two >= 16, the dot's minimum M).
    block_n: tokens per tile; block_d: head_dim padded to a power of two (>= 16).
    head_blocks: programs per KV head (``ceil(group / block_h)``).
    num_splits / split_len: the context is cut into `num_splits` chunks of
    `split_len` tokens (a multiple of block_n); 1 split skips the merge kernel.
    """

    block_h: int
    block_n: int
    block_d: int
    head_blocks: int
    num_splits: int
    split_len: int
    num_warps: int
    num_stages: int


def decode_config(
    batch: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_kv_len: int,
    num_sms: int,
    num_splits: int | None,
    fp32_dots: bool = False,
    gathered_scales: bool = False,
) -> DecodeConfig:
    """Tiles for the shape, and enough splits to give each SM about 4 programs (at most 64 splits, each
    at least 2 tiles).

    Three pipeline stages: page ids are fetched two tiles ahead, K/V one tile
    ahead. float32 dots (on CUDA cores) get half the tokens per tile and 8
    warps, and gathered FP8 scales no pipelining: both would spill registers
    otherwise (ptxas, sm_80 and sm_90).
    """
    block_d = max(16, triton_next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32 if block_d <= 256 else 16
    if fp32_dots:
        block_n = max(16, block_n // 2)
    block_h = min(max(16, triton_next_power_of_2(group)), 64 if block_d <= 128 else 16)
    head_blocks = math.ceil(group / block_h)
    tiles = max(1, math.ceil(max_kv_len / block_n))
    if num_splits is None:
        programs = batch * num_kv_heads * head_blocks
        num_splits = max(1, min(64, math.ceil(4 * num_sms / programs), tiles // 2))
    num_splits = max(1, min(num_splits, tiles))
    split_len = math.ceil(tiles / num_splits) * block_n
    num_splits = math.ceil(max(max_kv_len, 1) / split_len)
    num_warps = 8 if fp32_dots or block_d * max(block_h, block_n) > 64 * 128 else 4
    return DecodeConfig(
        block_h, block_n, block_d, head_blocks, num_splits, split_len, num_warps, 1 if gathered_scales else 3
    )


def triton_next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (triton's helper, without importing triton)."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check_kernel(
    query: torch.Tensor, kv_blocks: torch.Tensor, meta: PagedMetadata, layer: int, kv_scales: Any, checked: bool
) -> None:
    """What the kernel needs beyond `pagedkv.ops.checks` (a decode batch, contiguous pages, CUDA); all unless `checked`."""
    if meta.max_q_len != 1 or meta.num_tokens != meta.num_requests:
        raise ValueError(f"paged_decode takes decode batches (one token per request); got max_q_len="
                         f"{meta.max_q_len}, {meta.num_tokens} tokens for {meta.num_requests} requests")  # fmt: skip
    if not checked:
        _check_arguments(query, kv_blocks, meta, layer, kv_scales)
    if not kv_blocks.is_contiguous() or meta.lookup_table.stride(-1) != 1:
        raise ValueError("kv_blocks and the lookup table must be contiguous")
    if kv_scales is not None and (query.shape[-1] % kv_scales.shape[-1] or not kv_scales.is_contiguous()):
        raise ValueError(f"kv_scales {tuple(kv_scales.shape)} must be contiguous [..., G] with G | D")
    if query.device.type != "cuda" and not _kernels().INTERPRETED:
        raise ValueError(f"paged_decode needs CUDA tensors (or TRITON_INTERPRET=1); got {query.device}")


def _check_arguments(
    query: torch.Tensor, kv_blocks: torch.Tensor, meta: PagedMetadata, layer: int, kv_scales: torch.Tensor | None
) -> None:
    """Shapes, layer and devices of a direct call (the `pagedkv.ops` entry points check these themselves)."""
    if query.dim() != 3 or kv_blocks.dim() != 6 or query.shape[0] != meta.num_requests:
        raise ValueError(f"query {tuple(query.shape)} must be [B={meta.num_requests}, H_q, D]; kv_blocks must be 6-D")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_blocks.shape[4]
    if head_dim != kv_blocks.shape[5] or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_blocks {tuple(kv_blocks.shape)}: need the same head_dim "
            "and H_q a multiple of H_kv"
        )
    if not 0 <= layer < kv_blocks.shape[2]:
        raise ValueError(f"layer={layer} must be in [0, {kv_blocks.shape[2]})")
    if query.device != kv_blocks.device or (kv_scales is not None and kv_scales.shape[:5] != kv_blocks.shape[:5]):
        raise ValueError("query, kv_blocks and kv_scales ([*kv_blocks.shape[:5], G]) must fit, on one device")


def paged_decode(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
    kv_scales: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Decode attention of query [B, H_q, D] over each request's kv_lengths[b] cached positions.

    Same contract as `pagedkv.ops.reference.paged_attention_reference` for a
    batch of one token per request: GQA by ``h // (H_q // H_kv)``, logits
    ``q.k * scale`` (default 1/sqrt(D)), soft-capped if `softcap` is set,
    float32 softmax; FP8 pages are dequantized with `kv_scales` in the kernel.
    `num_splits` overrides the split count (tests use it to exercise the merge).
    Returns [B, H_q, D] in query's dtype. Raises ValueError for a batch that is
    not decode-only or shapes that do not fit. ``checked=True`` (the `pagedkv.ops`
    dispatcher, past its entry point's checks) checks only the kernel's own needs.
    """
    _check_kernel(query, kv_blocks, meta, layer, kv_scales, checked)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [B, H_q, D]
    if query.shape[0] == 0:
        return out
    kernels = _kernels()
    for launch in _launches(query, kv_blocks, meta, layer, scale, softcap, kv_scales, num_splits, out):
        getattr(kernels, launch.kernel)[launch.grid](*launch.args, **launch.constexprs)
    return out


@dataclass(frozen=True)
class _Launch:
    """One kernel launch: `kernel` (a name in the kernels module), grid, runtime args and constexprs."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]  # num_warps / num_stages included


def _launches(
    query: torch.Tensor,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    layer: int,
    scale: float | None,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    num_splits: int | None,
    out: torch.Tensor,
) -> list[_Launch]:
    """The split kernel, then the merge kernel unless one split suffices (see the kernels' module)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads, page_size = kv_blocks.shape[4], kv_blocks.shape[3]
    group = num_q_heads // num_kv_heads
    num_groups = 1 if kv_scales is None else kv_scales.shape[5]
    fold = kv_scales is not None and num_groups <= _MAX_FOLDED_GROUPS
    # Dot operands: the query's half dtype where the pages fit it exactly (see the kernels' module), else fp32.
    exact = kv_blocks.dtype == query.dtype or (kv_blocks.dtype in _FP8 and (fold or kv_scales is None))
    dot_fp32 = query.dtype not in _HALF or not exact
    gathered = kv_scales is not None and not fold
    interp_bf16 = query.dtype == torch.bfloat16 and _kernels().INTERPRETED  # work around two interpreter quirks
    sms = _num_sms(query.device)
    cfg = decode_config(batch, num_kv_heads, group, head_dim, meta.max_kv_len, sms, num_splits, dot_fp32, gathered)

    single = cfg.num_splits == 1
    if single:
        part_o = part_lse = out  # unused: the split kernel writes `out` itself
    else:
        part_o = out.new_empty((batch, num_q_heads, cfg.num_splits, head_dim), dtype=torch.float32)  # [B, H_q, S, D]
        part_lse = out.new_empty((batch, num_q_heads, cfg.num_splits), dtype=torch.float32)  # [B, H_q, S]
    kv = kv_blocks[:, 0, layer]  # [P + 1, page_size, H_kv, D] view at (K, layer)
    fp8_shift, fp8_mul = (0, 1.0) if _native_fp8(kv.dtype, kv.device) else _FP8_BITS[kv.dtype]
    if fp8_shift:
        kv = kv.view(torch.uint8)  # decoded from its bits in the kernel
    stride_kv = kv_blocks.stride(1) * (kv_blocks.shape[1] - 1)  # K -> V (0 for MLA: V is the latent)
    scales = kv if kv_scales is None else kv_scales[:, 0, layer]  # [P + 1, page_size, H_kv, G] (kv: never read)
    e8m0 = kv_scales is not None and kv_scales.dtype == _E8M0
    if e8m0:
        scales = scales.view(torch.uint8)  # biased exponents
    stride_sv = 0 if kv_scales is None else kv_scales.stride(1) * (kv_scales.shape[1] - 1)
    split = _Launch(
        "decode_split_kernel", (batch, num_kv_heads * cfg.head_blocks, cfg.num_splits),
        (
            query, kv, scales, meta.lookup_table, meta.kv_lengths, part_o, part_lse, out,
            1.0 / math.sqrt(head_dim) if scale is None else float(scale), 1.0 if softcap is None else float(softcap),
            cfg.split_len, *query.stride(),
            kv.stride(0), stride_kv, kv.stride(1), kv.stride(2),
            scales.stride(0), stride_sv, scales.stride(1), scales.stride(2),
            meta.lookup_table.stride(0),
            part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
        ),
        dict(
            GROUP=group, HEAD_BLOCKS=cfg.head_blocks, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            NUM_SCALE_GROUPS=num_groups, HAS_SCALES=kv_scales is not None, FOLD_SCALES=fold, SCALE_E8M0=e8m0,
            FP8_SHIFT=fp8_shift, FP8_MUL=fp8_mul, USE_SOFTCAP=softcap is not None, DOT_FP32=dot_fp32,
            INTERP_BF16=interp_bf16, SINGLE_SPLIT=single,
            BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ),
    )  # fmt: skip
    if single:
        return [split]
    merge = _Launch(
        "decode_merge_kernel", (batch, num_q_heads),
        (
            part_o, part_lse, meta.kv_lengths, out, cfg.split_len, cfg.num_splits,
            part_o.stride(0), part_o.stride(1), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
        ),
        dict(HEAD_DIM=head_dim, BLOCK_S=triton_next_power_of_2(cfg.num_splits), BLOCK_D=cfg.block_d,
             INTERP_BF16=interp_bf16),
    )  # fmt: skip
    return [split, merge]


@functools.cache
def _native_fp8(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether triton converts `dtype` pages natively on `device` (always for non-FP8 pages).

    e4m3fn needs sm_89+ (Ada, Hopper); the fnuz formats are AMD's. Elsewhere
    the kernel decodes the bytes itself (`_FP8_BITS`).
    """
    if dtype not in _FP8_BITS or device.type != "cuda":
        return True  # the interpreter converts every FP8 dtype
    if torch.version.hip is not None:
        return False
    if dtype == torch.float8_e5m2:
        return True
    return dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(device) >= (8, 9)


def available() -> bool:
    """True when the dispatcher may use `paged_decode`: triton, CUDA, and a passing self-check.

    The self-check (first call only; the answer is cached) runs a small random
    bfloat16 GQA decode batch, with one split and with three, and compares it
    with the reference. A failure logs one warning and disables the kernel.
    While a CUDA graph is being captured the check cannot run: the answer is
    False then, and not cached.
    """
    global _available
    if _available is not None:
        return _available
    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
        _available = False
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    try:
        err = _self_check(torch.device("cuda", torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - any failure (compile, launch, mismatch) disables the kernel
        logger.warning("Triton paged decode disabled: its self-check failed: %s", exc)
        _available = False
    else:
        logger.debug("Triton paged decode self-check passed (max error %.2e)", err)
        _available = True
    return _available


def _self_check(device: torch.device) -> float:
    """Max |kernel - reference| on a small decode batch; raises AssertionError beyond tolerance."""
    from pagedkv.ops import reference
    from pagedkv.runtime.inputs import RaggedKVCacheInputs, max_lengths_table

    gen = torch.Generator().manual_seed(0)
    batch, heads_kv, group, head_dim, page_size, layers = 3, 2, 4, 64, 16, 2
    cache = torch.tensor([0, 37, 70])  # [B] lengths before this step: the query sits at position cache[b]
    pages_per_req = math.ceil(int(cache.max() + 1) / page_size)
    num_pages = batch * pages_per_req
    blocks = torch.randn((num_pages + 1, 2, layers, page_size, heads_kv, head_dim), generator=gen)  # [P + 1, ...]
    lut = torch.randperm(num_pages, generator=gen).reshape(batch, pages_per_req).to(torch.int32)  # [B, C]
    query = torch.randn((batch, heads_kv * group, head_dim), generator=gen).to(torch.bfloat16)  # [B, H_q, D]
    blocks = blocks.to(torch.bfloat16)
    offsets = torch.arange(batch + 1)  # [B + 1]
    expected = reference.paged_attention_reference(query, blocks, lut, cache, offsets, 1, None, 30.0)
    inputs = RaggedKVCacheInputs(
        blocks.to(device), cache.to(device, torch.int32), lut.to(device), max_lengths_table(1, int(cache.max()) + 1)
    )
    meta = PagedMetadata.build(inputs, offsets.to(device), batch)
    worst = 0.0
    for splits in (1, 3):
        got = paged_decode(query.to(device), inputs.blocks, meta, 1, None, 30.0, num_splits=splits).cpu()
        torch.testing.assert_close(got.float(), expected.float(), atol=_SELF_CHECK_ATOL, rtol=_SELF_CHECK_RTOL)
        worst = max(worst, float((got.float() - expected.float()).abs().max()))
    return worst
