"""KV cache parameters from a transformers model config."""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.dtype import DeviceRef, DType
from pagedkv.params import KVCacheParams, KVCacheQuantizationConfig

__all__ = ["kv_params_from_config", "device_ref"]

SUPPORTED = ("llama", "qwen2", "qwen3")


def device_ref(device: torch.device) -> DeviceRef:
    """The `DeviceRef` of a torch device."""
    if device.type == "cuda":
        return DeviceRef.GPU(device.index or 0)
    return DeviceRef("meta", 0) if device.type == "meta" else DeviceRef.CPU()


def kv_params_from_config(
    config: Any,
    *,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    enable_prefix_caching: bool = True,
    kv_dtype: DType | None = None,
    quantization: KVCacheQuantizationConfig | None = None,
    **overrides: Any,
) -> KVCacheParams:
    """`KVCacheParams` for a decoder-only model config (Llama, Qwen2, Qwen3 attention).

    The cache stores `kv_dtype` (default: the model's `dtype`); an FP8
    `kv_dtype` with `quantization` gives scaled FP8 pages. Raises ValueError
    for a model type whose attention pagedkv does not run yet.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type={model_type!r} is not supported yet; supported: {SUPPORTED}")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVCacheParams(
        dtype=kv_dtype or DType.from_torch(dtype),
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        num_layers=config.num_hidden_layers,
        devices=[device_ref(device or torch.device("cpu"))],
        page_size=page_size,
        enable_prefix_caching=enable_prefix_caching,
        num_q_heads=heads,
        kvcache_quant_config=quantization,
        **overrides,
    )
