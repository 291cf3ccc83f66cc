"""The ``"pagedkv"`` attention implementation for transformers models.

The engine packs a ragged batch into one sequence: ``input_ids [1, T]`` with
explicit ``position_ids [1, T]`` and no transformers cache of KV, so every
attention layer calls `pagedkv_attention` with its new ``key``/``value``
``[1, H_kv, T, D]``. The layer's group (from `ForwardContext.layer_map`)
says which page table and which layer slot it uses, and which tokens it sees
(full, sliding window, chunked local, sinks): K/V are written into the pages
(`ops.store_kv`) and the queries attend over them (`ops.paged_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv import ops
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.params import KVCacheParams
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["ATTENTION_NAME", "ForwardContext", "GroupContext", "pagedkv_attention", "register"]

ATTENTION_NAME = "pagedkv"


@dataclass(frozen=True, eq=False)
class GroupContext:
    """One page-table group's inputs for this forward pass and the tokens its layers see."""

    inputs: RaggedKVCacheInputs
    metadata: PagedMetadata
    params: KVCacheParams

    def attention_options(self) -> dict[str, Any]:
        """`ops.paged_attention` keywords that follow from the group's attention kind."""
        p = self.params
        options: dict[str, Any] = {}
        if p.sliding_window is not None:
            options["sliding_window"] = p.sliding_window
        if p.attention_chunk_size is not None:
            options["chunk_size"] = p.attention_chunk_size
        if p.sink_tokens:
            options["sink_tokens"] = p.sink_tokens
        if p.is_cross_attention:
            options["causal"] = False
        return options


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What one forward pass needs to reach the pages: passed as ``model(..., pagedkv=ctx)``.

    Attributes:
        groups: one `GroupContext` per page-table group.
        input_row_offsets: int [B + 1], where each request's tokens start on the packed axis.
        layer_map: model layer index -> (group, layer slot in the group); empty means group 0, slot = index.
    """

    groups: list[GroupContext]
    input_row_offsets: torch.Tensor
    layer_map: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        inputs: list[RaggedKVCacheInputs],
        params: list[KVCacheParams],
        input_row_offsets: torch.Tensor,
        num_tokens: int,
        layer_map: dict[int, tuple[int, int]] | None = None,
    ) -> ForwardContext:
        """A context for one device: `inputs[g]` and `params[g]` per group, `num_tokens` packed tokens."""
        offsets = input_row_offsets.to(inputs[0].cache_lengths.device)
        groups = [
            GroupContext(i, PagedMetadata.build(i, offsets, num_tokens, causal=not p.is_cross_attention), p)
            for i, p in zip(inputs, params, strict=True)
        ]
        return cls(groups, offsets, dict(layer_map or {}))

    def locate(self, layer_idx: int) -> tuple[GroupContext, int]:
        """The group and layer slot of model layer `layer_idx`."""
        group, slot = self.layer_map.get(layer_idx, (0, layer_idx))
        return self.groups[group], slot


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
    Learned sinks (``s_aux``, gpt-oss) and ``softcap`` come from transformers'
    kwargs; windows and chunks from the layer's group. Raises ValueError when
    called without a ``pagedkv`` context or when transformers' window
    disagrees with the cache's.
    """
    ctx = kwargs.get(ATTENTION_NAME)
    if not isinstance(ctx, ForwardContext):
        raise ValueError(
            "attn_implementation='pagedkv' needs model(..., pagedkv=ForwardContext(...)); run the model through "
            "pagedkv.engine.LLMEngine, or switch the attention implementation back for a plain forward"
        )
    special = _special_attention(module)
    if special is not None:
        return special(module, query, key, value, ctx, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv packs the batch on the token axis: query batch must be 1, got {query.shape[0]}")
    group, slot = ctx.locate(int(module.layer_idx))  # type: ignore[arg-type]
    window = kwargs.get("sliding_window")
    if window is not None and window != group.params.sliding_window:
        raise ValueError(
            f"layer {module.layer_idx} attends a window of {window} but its cache keeps {group.params.sliding_window}"
        )
    q = query[0].transpose(0, 1)  # [T, H_q, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)  # [T, H_kv, D]
    ops.store_kv(k, v, group.inputs, ctx.input_row_offsets, slot, metadata=group.metadata)
    out = ops.paged_attention(
        q, group.inputs, ctx.input_row_offsets, slot, scale=scaling, softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"), metadata=group.metadata, **group.attention_options(),
    )  # fmt: skip  # [T, H_q, D]
    return out.unsqueeze(0), None  # [1, T, H_q, D]


def _special_attention(module: torch.nn.Module) -> Any:
    """The handler of a layer that is not plain self-attention over its own K/V, or None.

    MLA (a `kv_b_proj`): attention over cached latents (`pagedkv.hf.mla`). Encoder-decoder
    models (`is_decoder` set): encoder self-attention runs without pages, decoder
    cross-attention reads the encoder's pages (`pagedkv.hf.encoder_decoder`).
    """
    if hasattr(module, "kv_b_proj"):
        from pagedkv.hf import mla

        return mla.mla_attention
    is_decoder = getattr(module, "is_decoder", None)
    if is_decoder is None or (is_decoder and getattr(module, "is_causal", True)):
        return None
    from pagedkv.hf import encoder_decoder

    return encoder_decoder.cross_attention if is_decoder else encoder_decoder.encoder_attention


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for ``"pagedkv"``: none; the kernels apply causality and windows from positions."""
    return None


def register() -> str:
    """Register ``"pagedkv"`` with transformers' attention and mask interfaces (idempotent); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, pagedkv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
