"""DeepSeek V2/V3 multi-head latent attention (MLA) over pages that hold the *latent*, not per-head K/V.

transformers' ``DeepseekV2Attention.forward`` (V3 is the same) computes, for the
step's T tokens, the compressed latent ``k_nope = kv_a_layernorm(kv_nope)``
``[B, 1, T, r]`` (r = ``kv_lora_rank``) and the shared RoPE key ``k_pe``
``[B, 1, T, R]`` (R = ``qk_rope_head_dim``, after RoPE), hands both to
``past_key_values.update`` while they are still compressed, then expands the
result per head with ``kv_b_proj`` and calls the attention interface. pagedkv
hooks in at both points:

* `PagedLatentCache` is the ``past_key_values`` the engine passes
  (`model_kwargs`): its ``update`` writes each token's ``[k_nope | k_pe]``
  ``[T, 1, r + R]`` into the layer's pages (one slot per token, the MLA page
  layout of `pagedkv.hf.config.kv_layout`) and returns the new latents
  unchanged, so transformers expands only the new tokens (unused).
* `mla_attention` (dispatched from `pagedkv.hf.attention.pagedkv_attention` for
  any layer with a ``kv_b_proj``) ignores the expanded K/V and attends over the
  paged latents with the up-projection absorbed into the query and the output:
  with ``W = kv_b_proj.weight`` viewed as ``[H, nope + v, r]``,
  ``W_uk = W[:, :nope]`` and ``W_uv = W[:, nope:]``::

      score(t, s) = q_nope . (W_uk c_s) + q_pe . k_pe_s = [W_uk^T q_nope | q_pe] . [c_s | k_pe_s]
      out(t)      = sum_s p(t, s) W_uv c_s = W_uv (sum_s p(t, s) c_s)

  so the group's ``step.attend`` (`ops.paged_attention`) runs on ``[T, H, r + R]``
  queries against the single-head latent pages with ``v_head_dim=r`` (the values are the first r
  elements of each slot), and ``W_uv`` maps its ``[T, H, r]`` output to
  ``[T, H, v]``. The scores equal transformers' exactly (up to float rounding),
  so the softmax scale is the layer's own (``module.scaling``, yarn mscale
  included).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from pagedkv.hf.context import ForwardContext, GroupContext

__all__ = ["LatentProbe", "PagedLatentCache", "mla_attention", "model_kwargs"]


def model_kwargs(context: ForwardContext) -> dict[str, Any]:
    """Forward keywords of an MLA model step: a `PagedLatentCache` over `context`, with ``use_cache=True``."""
    return {"past_key_values": PagedLatentCache(context), "use_cache": True}


def _mla_group(ctx: ForwardContext, layer_idx: int) -> tuple[GroupContext, int]:
    """The group and slot of `layer_idx`; ValueError unless the group's pages are MLA pages."""
    group, slot = ctx.locate(layer_idx)
    if not group.params.is_mla:
        raise ValueError(
            f"layer {layer_idx} is an MLA layer but its cache group is not (is_mla=False); build the cache with "
            "pagedkv.hf.kv_layout(config)"
        )
    return group, slot


class PagedLatentCache(Cache):
    """A transformers `Cache` for one forward pass that writes MLA latents into pagedkv pages.

    Contract: ``update(k_nope [1, 1, T, r], k_pe [1, 1, T, R], layer_idx)``
    stores ``cat(k_nope, k_pe)`` as ``[T, 1, r + R]`` into the pages of model
    layer `layer_idx` at the step's token slots (``step.store`` of the
    layer's group: `ops.store_kv`) and returns ``(k_nope, k_pe)`` unchanged: the cached
    past is read by `mla_attention`, never by transformers. The cache keeps no
    tensors itself (``layers`` is empty), so ``get_seq_length()`` is 0 and
    transformers' mask sizing sees only the step's tokens; positions must be
    passed explicitly (``position_ids``), as the engine does.
    """

    def __init__(self, context: ForwardContext) -> None:
        super().__init__(layers=[])
        self.context = context

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's latents of `layer_idx` in the pages; returns them unchanged (see the class docstring)."""
        if key_states.dim() != 4 or key_states.shape[:2] != (1, 1) or value_states.shape[:3] != key_states.shape[:3]:
            raise ValueError(
                f"MLA latents must be [1, 1, T, r] and [1, 1, T, R], got {tuple(key_states.shape)} and "
                f"{tuple(value_states.shape)} (pagedkv packs the batch on the token axis)"
            )
        group, slot = _mla_group(self.context, layer_idx)
        latent = torch.cat((key_states[0, 0], value_states[0, 0]), dim=-1)  # [T, r + R]
        group.step.store(latent.unsqueeze(1), None, slot)  # [T, 1, r + R] into the pages
        return key_states, value_states


class LatentProbe(Cache):
    """A transformers `Cache` that records the width of the latents each MLA layer caches (`pagedkv.hf.probe`).

    ``update(k_nope [B, 1, T, r], k_pe [B, 1, T, R], layer_idx)`` sets ``seen[layer_idx] = (1, r + R)`` (what
    `PagedLatentCache` stores per token) and returns the latents unchanged; it keeps no tensors.
    """

    def __init__(self, seen: dict[int, tuple[int, int]]) -> None:
        super().__init__(layers=[])
        self.seen = seen

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the layer's latent width; returns the latents unchanged."""
        self.seen.setdefault(int(layer_idx), (1, key_states.shape[-1] + value_states.shape[-1]))
        return key_states, value_states


def mla_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx: ForwardContext,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Absorbed MLA attention of a DeepSeek attention `module` over its paged latents.

    query [1, H, T, nope + R] (``cat(q_nope, q_pe)`` after RoPE, as transformers
    builds it) -> ([1, T, H, v], None). `key`/`value` (the per-head expansion
    of the step's latents) are ignored: the step's latents must already be in
    the pages, which `PagedLatentCache.update` does earlier in the same layer.
    `scaling` defaults to ``module.scaling``. Raises ValueError for a batched
    query, a non-MLA cache group, or a ``kv_b_proj`` with a bias or a shape
    that disagrees with the module's head sizes.
    """
    if query.shape[0] != 1:
        raise ValueError(f"pagedkv packs the batch on the token axis: query batch must be 1, got {query.shape[0]}")
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
    group, slot = _mla_group(ctx, layer_idx)
    rank, nope, v_dim = int(module.kv_lora_rank), int(module.qk_nope_head_dim), int(module.v_head_dim)  # type: ignore[arg-type]
    kv_b_proj = module.kv_b_proj
    assert isinstance(kv_b_proj, torch.nn.Linear)
    if kv_b_proj.bias is not None:
        raise ValueError(f"layer {layer_idx}: kv_b_proj has a bias, which absorbed MLA attention does not handle")
    heads = query.shape[1]
    if tuple(kv_b_proj.weight.shape) != (heads * (nope + v_dim), rank):
        raise ValueError(
            f"layer {layer_idx}: kv_b_proj.weight {tuple(kv_b_proj.weight.shape)} != "
            f"[H * (nope + v), r] = [{heads * (nope + v_dim)}, {rank}]"
        )
    w = kv_b_proj.weight.to(query.dtype).view(heads, nope + v_dim, rank)  # [H, nope + v, r]
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, r], [H, v, r]
    q = query[0].transpose(0, 1)  # [T, H, nope + R]
    q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, H, nope], [T, H, R]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, r]
    q_absorbed = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, r + R]
    scale = float(module.scaling) if scaling is None else scaling
    out_latent = group.step.attend(q_absorbed, slot, scale=scale, v_head_dim=rank)  # [T, H, r]
    out = torch.einsum("thr,hvr->thv", out_latent.to(query.dtype), w_uv)  # [T, H, v]
    return out.unsqueeze(0), None  # [1, T, H, v]
