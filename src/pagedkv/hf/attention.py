"""The ``"pagedkv"`` attention implementation for transformers models.

The engine packs a ragged batch into one sequence: ``input_ids [1, T]`` with
explicit ``position_ids [1, T]`` and ``use_cache=False``, so transformers keeps
no cache of its own. Every attention layer then calls `pagedkv_attention`
with its new ``key``/``value`` ``[1, H_kv, T, D]``: they are written into the
layer's pages (`ops.store_kv`) and the queries attend over the pages
(`ops.paged_attention`), request by request as `input_row_offsets` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv import ops
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["ATTENTION_NAME", "ForwardContext", "pagedkv_attention", "register"]

ATTENTION_NAME = "pagedkv"


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What one forward pass needs to reach the pages: passed as ``model(..., pagedkv=ctx)``.

    Attributes:
        inputs: the device's `RaggedKVCacheInputs` from `PagedKVCacheManager.runtime_inputs`.
        input_row_offsets: int [B + 1], where each request's tokens start on the packed axis.
        metadata: the step's `PagedMetadata` (built once, shared by every layer).
    """

    inputs: RaggedKVCacheInputs
    input_row_offsets: torch.Tensor
    metadata: PagedMetadata

    @classmethod
    def build(cls, inputs: RaggedKVCacheInputs, input_row_offsets: torch.Tensor, num_tokens: int) -> ForwardContext:
        """A context with its metadata for a batch of `num_tokens` packed tokens."""
        offsets = input_row_offsets.to(inputs.cache_lengths.device)
        return cls(inputs, offsets, PagedMetadata.build(inputs, offsets, num_tokens))


def pagedkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Store this layer's new K/V in its pages and attend over them.

    query [1, H_q, T, D], key/value [1, H_kv, T, D] -> ([1, T, H_q, D], None).
    Raises ValueError when called without a ``pagedkv`` context, or with a
    feature this implementation does not provide (sliding window, sinks).
    """
    ctx = kwargs.get(ATTENTION_NAME)
    if not isinstance(ctx, ForwardContext):
        raise ValueError(
            "attn_implementation='pagedkv' needs model(..., pagedkv=ForwardContext(...)); run the model through "
            "pagedkv.engine.LLMEngine, or switch the attention implementation back for a plain forward"
        )
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv packs the batch on the token axis: query batch must be 1, got {query.shape[0]}")
    for feature in ("sliding_window", "s_aux"):
        if kwargs.get(feature) is not None:
            raise ValueError(f"{type(module).__name__} uses {feature}, which this attention does not implement yet")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q = query[0].transpose(0, 1)  # [T, H_q, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)  # [T, H_kv, D]
    ops.store_kv(k, v, ctx.inputs, ctx.input_row_offsets, layer, metadata=ctx.metadata)
    out = ops.paged_attention(
        q, ctx.inputs, ctx.input_row_offsets, layer, scale=scaling, softcap=kwargs.get("softcap"),
        metadata=ctx.metadata,
    )  # fmt: skip  # [T, H_q, D]
    return out.unsqueeze(0), None  # [1, T, H_q, D]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for ``"pagedkv"``: none; causality comes from page positions."""
    return None


def register() -> str:
    """Register ``"pagedkv"`` with transformers' attention and mask interfaces (idempotent); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
