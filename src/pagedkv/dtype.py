"""Element types and device references, described without importing torch.

`DType` and `DeviceRef` are plain values that the bookkeeping layer can hold
and compare. `to_torch()` imports torch lazily, the first time a tensor-side
caller asks for it.
"""

from __future__ import annotations

import builtins
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["DType", "DeviceRef"]


class DType(enum.Enum):
    """An element type of a KV cache buffer; the value is the torch attribute name."""

    bool = "bool"
    uint8 = "uint8"
    int8 = "int8"
    uint16 = "uint16"
    int16 = "int16"
    uint32 = "uint32"
    int32 = "int32"
    uint64 = "uint64"
    int64 = "int64"
    float8_e4m3fn = "float8_e4m3fn"
    float8_e4m3fnuz = "float8_e4m3fnuz"
    float8_e5m2 = "float8_e5m2"
    float8_e5m2fnuz = "float8_e5m2fnuz"
    float8_e8m0fnu = "float8_e8m0fnu"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"

    @property
    def size_in_bytes(self) -> int:
        """Bytes per element."""
        return _SIZES[self.value]

    @property
    def is_float8(self) -> builtins.bool:
        """True for the 8-bit floating point formats."""
        return self.value.startswith("float8")

    @property
    def is_float(self) -> builtins.bool:
        """True for every floating point format (float8 included)."""
        return self.value.startswith(("float", "bfloat"))

    def to_torch(self) -> torch.dtype:
        """The matching `torch.dtype` (imports torch)."""
        import torch

        result = getattr(torch, self.value, None)
        if result is None:
            raise TypeError(f"dtype={self.name} is not available in torch {torch.__version__}")
        return result

    @classmethod
    def from_torch(cls, dtype: Any) -> DType:
        """The `DType` of a `torch.dtype` such as `torch.bfloat16`."""
        name = str(dtype).removeprefix("torch.")
        try:
            return cls(name)
        except ValueError:
            raise TypeError(f"dtype={dtype!r} has no pagedkv DType") from None


_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float16": 2, "bfloat16": 2, "float32": 4,
    "float64": 8,
}  # fmt: skip


_DEVICE_TYPES = ("cpu", "gpu", "meta")


@dataclass(frozen=True)
class DeviceRef:
    """A device by kind and index: `DeviceRef.CPU()`, `DeviceRef.GPU(1)`.

    `META()` is torch's storage-less device: buffers on it have shapes and no
    bytes, which is what memory planning and bookkeeping benchmarks want.
    Equal refs may be listed more than once in `KVCacheParams.devices`; each
    entry is then its own shard (several CPU shards model TP without GPUs).
    """

    device_type: str = "cpu"
    id: int = 0

    def __post_init__(self) -> None:
        if self.device_type not in _DEVICE_TYPES:
            raise ValueError(f"device_type={self.device_type!r} must be one of {_DEVICE_TYPES}")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 0:
            raise ValueError(f"id={self.id!r} must be an integer >= 0")

    @staticmethod
    def CPU(id: int = 0) -> DeviceRef:  # noqa: N802 - MAX's spelling
        """The host CPU."""
        return DeviceRef("cpu", id)

    @staticmethod
    def GPU(id: int = 0) -> DeviceRef:  # noqa: N802 - MAX's spelling
        """CUDA device `id`."""
        return DeviceRef("gpu", id)

    @staticmethod
    def META() -> DeviceRef:  # noqa: N802 - matches CPU()/GPU()
        """torch's meta device: shapes without storage."""
        return DeviceRef("meta", 0)

    def is_cpu(self) -> bool:
        """True for the host CPU."""
        return self.device_type == "cpu"

    def to_torch(self) -> torch.device:
        """The matching `torch.device` (imports torch)."""
        import torch

        if self.device_type == "gpu":
            return torch.device("cuda", self.id)
        return torch.device(self.device_type)

    def __str__(self) -> str:
        return f"{self.device_type}:{self.id}"
