"""FP8 paged KV caches: vectorised quantization and store are bit-identical to the reference,
attention matches the reference, and FP8 attention stays close to the same batch in float32."""

from __future__ import annotations

import pytest
import torch
from test_ops import attention, make_manager, ragged_steps, store_both, torch_outputs

from pagedkv.dtype import DType
from pagedkv.ops import torch_ops
from pagedkv.ops.fp8 import dequantize_reference, quantize_reference
from pagedkv.params import KVCacheQuantizationConfig

# |FP8 attention - float32 attention| over the four steps of `ragged_steps` (unit-normal Q/K/V,
# head_dim 128, page size 3), measured for seeds 0-5 and every configuration below: max 0.090-0.168,
# mean <= 0.0131. e4m3 keeps 3 mantissa bits (each K/V element is off by up to 2^-4 of itself), and
# the logit errors that follow are amplified where the softmax is sharp. Power-of-two (e8m0) scales
# leave mantissas alone, so granularity 64 and 128 give identical errors there.
FP8_MAX_ATOL = 0.25
FP8_MEAN_ATOL = 0.025


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """[T=6, H=2, D=128]: zeros, exact powers of two, huge and tiny magnitudes, an FP8-max multiple, noise."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 128, generator=gen)
    x[0] = 0.0
    x[1, 0] = 2.0 ** torch.randint(-20, 20, (128,), generator=gen).float()
    x[1, 1, :64] = 0.0  # one all-zero group (scale 1.0) next to a live one
    x[2] *= 1e4
    x[3] *= 1e-6
    x[4] = torch.finfo(dtype).max * torch.sign(x[4]) * 4.0  # amax / scale lands exactly on the FP8 max
    x[5, :, ::2] = -x[5, :, 1::2]
    return x


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_quantize_is_bit_identical_to_reference(dtype: torch.dtype, scale_dtype: torch.dtype, groups: int) -> None:
    x = edge_values(dtype)
    q, s = torch_ops.quantize(x, groups, dtype, scale_dtype)  # [T, H, D], [T, H, G]
    assert q.dtype == dtype and s.dtype == scale_dtype and s.shape == (6, 2, groups)
    for t in range(x.shape[0]):
        q_ref, s_ref = quantize_reference(x[t], groups, dtype, scale_dtype)
        assert torch.equal(q[t].view(torch.uint8), q_ref.view(torch.uint8)), f"token {t}"
        assert torch.equal(s[t].view(torch.uint8), s_ref.view(torch.uint8)), f"token {t}"
        assert torch.equal(torch_ops.dequantize(q[t], s[t]), dequantize_reference(q_ref, s_ref))
    assert torch.equal(s[0].float(), torch.ones(2, groups))  # all-zero groups get scale 1.0


@pytest.mark.parametrize(
    "dtype,granularity,scale_dtype",
    [
        (DType.float8_e4m3fn, 64, DType.float32),
        (DType.float8_e4m3fn, 128, DType.float32),
        (DType.float8_e4m3fn, 64, DType.float8_e8m0fnu),
        (DType.float8_e4m3fn, 128, DType.float8_e8m0fnu),
        (DType.float8_e4m3fnuz, 64, DType.float32),
    ],
)
def test_fp8_cache_matches_reference_and_float32(
    dtype: DType, granularity: int, scale_dtype: DType, monkeypatch: pytest.MonkeyPatch
) -> None:
    quant = KVCacheQuantizationConfig(scale_dtype, granularity)
    fp8 = make_manager(3, head_dim=128, dtype=dtype, quant=quant)
    fp32 = make_manager(3, head_dim=128)
    worst, means = 0.0, []
    # Same schedule, same seed: both managers hand out the same pages and see the same Q/K/V.
    for step, twin in zip(ragged_steps(fp8, 4), ragged_steps(fp32, 4), strict=True):
        store_both(step)  # pages and scales bit-identical to the reference
        assert step.inputs.kv_scales is not None and step.inputs.kv_scales.shape[-1] == 128 // granularity
        want = attention(step, "reference")
        for name, got in torch_outputs(step, monkeypatch).items():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        store_both(twin)
        exact = attention(twin, "torch")
        worst = max(worst, (want - exact).abs().max().item())
        means.append((want - exact).abs().mean().item())
    assert 0.0 < worst < FP8_MAX_ATOL and max(means) < FP8_MEAN_ATOL


def test_fp8_attention_with_a_bf16_query(monkeypatch: pytest.MonkeyPatch) -> None:
    quant = KVCacheQuantizationConfig(DType.float32, 64)
    mgr = make_manager(3, head_dim=128, dtype=DType.float8_e4m3fn, quant=quant)
    for step in ragged_steps(mgr, 4):
        store_both(step)
        step.query = step.query.to(torch.bfloat16)
        want = attention(step, "reference")
        assert want.dtype == torch.bfloat16
        for got in torch_outputs(step, monkeypatch).values():
            torch.testing.assert_close(got, want, atol=8e-3, rtol=8e-3)  # one bf16 rounding of a float32 result
