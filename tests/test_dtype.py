"""DType and DeviceRef: sizes, torch mapping, validation."""

from __future__ import annotations

import pytest
import torch

from pagedkv.dtype import DeviceRef, DType


@pytest.mark.parametrize("dtype", list(DType))
def test_size_matches_torch(dtype: DType) -> None:
    t = dtype.to_torch()
    assert dtype.size_in_bytes == t.itemsize
    assert DType.from_torch(t) is dtype


def test_flags() -> None:
    assert DType.float8_e4m3fn.is_float8 and DType.bfloat16.is_float and not DType.int32.is_float
    with pytest.raises(TypeError, match="has no pagedkv DType"):
        DType.from_torch(torch.complex64)


def test_device_ref() -> None:
    assert DeviceRef.CPU().to_torch() == torch.device("cpu")
    assert DeviceRef.GPU(3).to_torch() == torch.device("cuda", 3)
    assert DeviceRef.META().to_torch() == torch.device("meta")
    assert DeviceRef.CPU() == DeviceRef.CPU() and str(DeviceRef.GPU(1)) == "gpu:1"
    with pytest.raises(ValueError, match="device_type='tpu' must be one of"):
        DeviceRef("tpu")
    with pytest.raises(ValueError, match="id=-1 must be an integer >= 0"):
        DeviceRef.GPU(-1)
