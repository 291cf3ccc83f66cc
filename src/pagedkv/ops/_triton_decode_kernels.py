# ruff: noqa: N803, N806 - triton spells compile-time constants in capitals
"""Triton kernels of the paged decode (imported lazily by `pagedkv.ops.triton_decode`: needs triton).

Split-K ("flash-decoding") in two launches:

1. `decode_split_kernel`, grid ``(B, H_kv * head_blocks, num_splits)``: one
   program takes up to BLOCK_H query heads of one KV head (GQA: they share
   every K/V tile) and the positions ``[split * split_len, (split + 1) *
   split_len)`` of one request, BLOCK_N tokens at a time. Each token's page
   comes from the lookup table (any page size), so a tile may span pages.
   Online softmax in float32, log2 domain. With one split it writes the final
   output; otherwise the normalised partial output and its log-sum-exp.
2. `decode_merge_kernel`, grid ``(B, H_q)``: merges a request's splits,
   weighting each by ``exp2(lse - max lse)``.

Dot operands are the query's dtype when it is fp16/bf16 and the pages fit it
exactly (same dtype, or FP8), else float32. In half precision the
probabilities enter the P @ V dot as a sum of two half-precision parts
(`_dot_p`), so the result is about as accurate as float32 math.

FP8 pages with per-group scales: with FOLD_SCALES (few groups) the
scales are folded into the other operand (``q.k = sum_g s_g (q_g . k_g)`` and
``(p * s_g) @ v`` on group g's columns, one dot per group), so the FP8 tiles go
to the dots unchanged (exact in fp16/bf16). With more groups each element is
dequantized with a gathered scale and the dots run in float32.
float8_e8m0fnu scales arrive as uint8 exponents.

`INTERPRETED` records whether ``TRITON_INTERPRET=1`` was set when the kernels
were defined: they then run on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    t = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: never overflows
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _dot(a, b, INTERP_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    # a @ b with float32 accumulation. INTERP_BF16: widen the (already rounded) operands first, for the
    # interpreter, whose tl.dot multiplies bfloat16 bit patterns (it stores them as uint16).
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _to_out(x, out_ptr, INTERP_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    # float32 -> the output dtype. The interpreter truncates to bfloat16 where GPUs round to nearest
    # even: round by hand there (adding half an ulp, ties to even, before the truncation).
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        x = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _load_kv(ptrs, mask, FP8_SHIFT: tl.constexpr, FP8_MUL: tl.constexpr):  # type: ignore[no-untyped-def]
    """A K/V tile; FP8_SHIFT > 0: FP8 bytes this GPU cannot convert, rebuilt as float16 (exactly): the
    7 bits below the sign land under float16's 5-bit exponent, and FP8_MUL fixes the exponent bias.
    NaN bytes come out as finite numbers (saturating quantizers never write them)."""
    if FP8_SHIFT == 0:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:  # (one return: compiled triton wants the same return type from every branch, even constexpr ones)
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint16)
        tile = (((bits & 0x7F) << FP8_SHIFT) | ((bits & 0x80) << 8)).to(tl.float16, bitcast=True) * FP8_MUL
    return tile


@triton.jit
def _scale(scale_ptr, offs, mask, SCALE_E8M0: tl.constexpr):  # type: ignore[no-untyped-def]
    s = tl.load(scale_ptr + offs, mask=mask, other=0)
    if SCALE_E8M0:
        return tl.exp2(s.to(tl.float32) - 127.0)  # e8m0: a biased power-of-two exponent
    return s.to(tl.float32)


@triton.jit
def _dot_p(p, v, INTERP_BF16: tl.constexpr, SPLIT_P: tl.constexpr):  # type: ignore[no-untyped-def]
    """p [M, N] float32 @ v [N, D]. SPLIT_P (v in fp16/bf16): p goes in as the sum of two half-precision
    parts, keeping about 16 of its bits instead of 8 (bf16); the extra dot is free in a memory-bound kernel."""
    p_hi = p.to(v.dtype)
    out = _dot(p_hi, v, INTERP_BF16)
    if SPLIT_P:
        out += _dot((p - p_hi.to(tl.float32)).to(v.dtype), v, INTERP_BF16)
    return out


@triton.jit
def decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, kv_ptr, scale_ptr, lut_ptr, kv_len_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    sm_scale, softcap, split_len,
    stride_qb, stride_qh, stride_qd,
    stride_kp, stride_kv, stride_ks, stride_kh,
    stride_sp, stride_sv, stride_ss, stride_sh,
    stride_lb,
    stride_pb, stride_ph, stride_eb, stride_eh,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SCALE_GROUPS: tl.constexpr, HAS_SCALES: tl.constexpr, FOLD_SCALES: tl.constexpr, SCALE_E8M0: tl.constexpr,
    FP8_SHIFT: tl.constexpr, FP8_MUL: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr, INTERP_BF16: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """kv_ptr/scale_ptr already point at (layer, K); V is ``stride_kv`` / ``stride_sv`` further."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    if split == tl.num_programs(2) - 1:  # the last split takes the rest, should max_kv_len have been short
        end = kv_len

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] heads within the GQA group
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = offs_d < HEAD_DIM
    GROUP_SIZE: tl.constexpr = HEAD_DIM // NUM_SCALE_GROUPS
    SPLIT_P: tl.constexpr = not DOT_FP32
    d_group = offs_d // GROUP_SIZE  # [BLOCK_D] scale group of each element

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    if USE_SOFTCAP:
        qk_scale = sm_scale / softcap

    k_base = kv_ptr + kv_head * stride_kh
    s_base = scale_ptr + kv_head * stride_sh
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute positions
        mask_n = pos < end
        page = tl.load(lut_ptr + b * stride_lb + pos // PAGE_SIZE, mask=mask_n, other=0)  # [BLOCK_N] int64
        slot = pos % PAGE_SIZE  # [BLOCK_N]
        kv_offs = page * stride_kp + slot * stride_ks  # [BLOCK_N]
        s_offs = page * stride_sp + slot * stride_ss  # [BLOCK_N]
        mask_nd = mask_n[:, None] & mask_d[None, :]
        tile_offs = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]

        k = _load_kv(k_base + tile_offs, mask_nd, FP8_SHIFT, FP8_MUL)  # [BLOCK_N, BLOCK_D]
        if FOLD_SCALES:  # qk = sum_g s_g (q_g . k_g): the FP8 tile goes to the dot as is (exact in fp16/bf16)
            k = k.to(q.dtype)
            qk = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            for g in tl.static_range(NUM_SCALE_GROUPS):
                q_g = tl.where((d_group == g)[None, :], q, 0.0).to(q.dtype)  # [BLOCK_H, BLOCK_D]
                s_g = _scale(s_base, s_offs + g, mask_n, SCALE_E8M0)  # [BLOCK_N]
                qk += _dot(q_g, tl.trans(k), INTERP_BF16) * s_g[None, :]
        else:
            if HAS_SCALES:  # many groups: dequantize with one gathered scale per element (float32 dots)
                k = k.to(tl.float32) * _scale(s_base, s_offs[:, None] + d_group[None, :], mask_nd, SCALE_E8M0)
            qk = _dot(q, tl.trans(k.to(q.dtype)), INTERP_BF16)  # [BLOCK_H, BLOCK_N] fp32
        if USE_SOFTCAP:
            qk = (softcap * LOG2E) * _tanh(qk * qk_scale)
        else:
            qk = qk * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_H]
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new

        v = _load_kv(k_base + stride_kv + tile_offs, mask_nd, FP8_SHIFT, FP8_MUL).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        if FOLD_SCALES:  # p @ (s_g v) = (p s_g) @ v on group g's columns: the FP8 tile stays exact
            for g in tl.static_range(NUM_SCALE_GROUPS):
                s_g = _scale(s_base + stride_sv, s_offs + g, mask_n, SCALE_E8M0)  # [BLOCK_N]
                pv = _dot_p(p * s_g[None, :], v, INTERP_BF16, SPLIT_P)  # [BLOCK_H, BLOCK_D]
                if NUM_SCALE_GROUPS == 1:
                    acc += pv
                else:
                    acc += tl.where((d_group == g)[None, :], pv, 0.0)
        else:
            if HAS_SCALES:
                v *= _scale(s_base + stride_sv, s_offs[:, None] + d_group[None, :], mask_nd, SCALE_E8M0)
            acc += _dot_p(p, v, INTERP_BF16, SPLIT_P)  # [BLOCK_H, BLOCK_D]

    mask_hd = mask_h[:, None] & mask_d[None, :]
    if SINGLE_SPLIT:
        out_offs = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
        tl.store(out_ptr + out_offs, _to_out(acc / l_i[:, None], out_ptr, INTERP_BF16), mask=mask_hd)
    elif start < kv_len:  # splits past the request's end leave their rows unwritten
        part_o = b * stride_pb + heads * stride_ph + split * HEAD_DIM  # [BLOCK_H]
        tl.store(part_o_ptr + part_o[:, None] + offs_d[None, :], acc / l_i[:, None], mask=mask_hd)
        part_lse = b * stride_eb + heads * stride_eh + split  # [BLOCK_H]
        tl.store(part_lse_ptr + part_lse, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def decode_merge_kernel(  # type: ignore[no-untyped-def]
    part_o_ptr, part_lse_ptr, kv_len_ptr, out_ptr,
    split_len, num_splits,
    stride_pb, stride_ph, stride_eb, stride_eh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, INTERP_BF16: tl.constexpr,
):  # fmt: skip
    """out[b, h] = sum_s w_s o_s / sum_s w_s with w_s = exp2(lse_s - max lse), over the request's splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    num_valid = tl.minimum(tl.cdiv(kv_len, split_len), num_splits)  # splits holding at least one position
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    lse_row = part_lse_ptr + b * stride_eb + h * stride_eh  # this row's [num_splits] log-sum-exps
    o_row = part_o_ptr + b * stride_pb + h * stride_ph  # this row's [num_splits, HEAD_DIM] outputs
    lse = tl.load(lse_row + offs_s, mask=offs_s < num_valid, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    denom = tl.sum(tl.exp2(lse - lse_max), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(num_valid):
        w = tl.exp2(tl.load(lse_row + s) - lse_max)
        acc += w * tl.load(o_row + s * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)  # [BLOCK_D]
    out = acc / denom  # [BLOCK_D]
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d, _to_out(out, out_ptr, INTERP_BF16), mask=offs_d < HEAD_DIM
    )
