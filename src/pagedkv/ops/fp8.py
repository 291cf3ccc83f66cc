"""FP8 (e4m3) page quantization: one scale per (token, head, group of head_dim elements).

``scale = max(|x| over the group) / FP8_MAX`` (1.0 for an all-zero group), the
page stores ``x / scale`` rounded to float8, and reading multiplies back.
"""

from __future__ import annotations

import torch

__all__ = ["fp8_max", "fp8_scales", "quantize_reference", "dequantize_reference"]


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def fp8_scales(amax: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 scales for groups with max magnitude `amax`, exactly representable in `scale_dtype`.

    float8_e8m0fnu holds powers of two only: the scale is rounded *up* to one,
    so no quantized value overflows.
    """
    scale = torch.where(amax > 0, amax.float() / fp8_max(dtype), torch.ones_like(amax, dtype=torch.float32))
    if scale_dtype == getattr(torch, "float8_e8m0fnu", None):
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
    return scale


def quantize_reference(
    x: torch.Tensor, num_groups: int, dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [H, D] to `dtype` with `num_groups` scales per head: returns ([H, D], [H, num_groups])."""
    heads, dim = x.shape
    groups = x.float().reshape(heads, num_groups, dim // num_groups)  # [H, G, D/G]
    scale = fp8_scales(groups.abs().amax(dim=-1), dtype, scale_dtype)  # [H, G]
    q = (groups / scale.unsqueeze(-1)).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)  # [H, G, D/G]
    return q.reshape(heads, dim), scale.to(scale_dtype)


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to `dtype`: q [H, D] times its per-group scale [H, G]."""
    heads, dim = q.shape
    groups = scale.shape[-1]
    x = q.float().reshape(heads, groups, dim // groups) * scale.float().unsqueeze(-1)  # [H, G, D/G]
    return x.reshape(heads, dim).to(dtype)
