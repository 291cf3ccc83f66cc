"""The ``"pagedkv"`` attention implementation for transformers models.

The engine packs a ragged batch into one sequence: ``input_ids [1, T]`` with
explicit ``position_ids [1, T]`` and no transformers cache of KV, so every
attention layer calls `pagedkv_attention` with its new ``key``/``value``
``[1, H_kv, T, D]``. The layer's group (from `ForwardContext.layer_map`)
says which page table and which layer slot it uses, and which tokens it sees
(full, sliding window, chunked local, sinks): K/V are written into the pages
(``step.store``) and the queries attend over them (``step.attend``), with the
group's `ops.PagedStep` that `ForwardContext.build` checked and built once for
the whole pass (`pagedkv.hf.context`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.hf.context import ATTENTION_NAME, ForwardContext, GroupContext, current

__all__ = ["ATTENTION_NAME", "ForwardContext", "GroupContext", "pagedkv_attention", "register"]


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
    The context is the ``pagedkv`` keyword or, for decoder layers that drop keywords (StableLM), the one
    the engine made current for the pass (`pagedkv.hf.context.active`).
    Learned sinks (``s_aux``, gpt-oss) and ``softcap`` come from transformers'
    kwargs; windows and chunks from the layer's group. Raises ValueError when
    called without a ``pagedkv`` context or when transformers' window
    disagrees with the cache's.
    """
    ctx = kwargs.get(ATTENTION_NAME) or current()  # the keyword, else the engine's current pass
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
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        q = _own_temperature(q, ctx)  # [T, H_q, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)  # [T, H_kv, D]
    group.step.store(k, v, slot)
    out = group.step.attend(
        q, slot, scale=scaling, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), key=k, value=v
    )  # [T, H_q, D]; requests with no cached prefix may attend over k, v directly
    return out.unsqueeze(0), None  # [1, T, H_q, D]


def _own_temperature(q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """Llama 4 NoPE queries q [T, H_q, D] scaled for each token's own position, not its packed index.

    transformers scaled them by ``f(arange(T))``; ``ctx.query_scale`` [T, 1, 1] is ``f(position) / f(arange(T))``
    (`pagedkv.hf.positions`), applied in float32 as transformers applies its scale. Raises ValueError when the
    context was built without the model config (so without the factor).
    """
    if ctx.query_scale is None:
        raise ValueError(
            "this Llama 4 layer tunes its attention temperature by position: build the ForwardContext with "
            "model_config=model.config (LLMEngine does)"
        )
    return (q.float() * ctx.query_scale).to(q.dtype)  # [T, H_q, D]


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
