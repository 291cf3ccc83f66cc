"""ALiBi decoders (Bloom, MPT, Falcon with ``alibi=True``) and rotary Falcon on pagedkv pages.

Their attention modules compute attention themselves (no `AttentionInterface`)
and take the ALiBi bias as a dense tensor built by the model. `install` wraps
each attention module's ``forward``: while an engine's `ForwardContext` is
active (`pagedkv.hf.context.active`), the wrapper projects Q/K/V with the
module's own weights, stores K/V in the pages and attends with
`pagedkv.hf.attention.pagedkv_attention`, ignoring the model's dense bias and
mask (rotary Falcon: rotating Q/K with the ``position_embeddings`` its layer
passes, computed from the engine's ``position_ids``); outside one (e.g. the model's own ``generate``) it runs the original
forward. The per-head slopes come once per model from the model's own slope
function (`slopes`) and join every step's attention options, so the kernels add
``slope[h] * (k - q)`` to each logit: Bloom adds ``slope * k`` to the scaled
logits and MPT ``slope * (k - (L - 1))``, both the same up to a per-query
constant; Falcon adds ``slope * k`` before scaling (its slopes are multiplied by
the scale here; its eager path adds the bias a second time through the mask, so
under ``eager`` they are doubled as well, to match it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WRAPPED_TYPES", "install", "kv_shape", "observe", "slopes", "wrapped_type"]


_QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Spec:
    split: Callable[[Any, torch.Tensor], _QKV]  # hidden [B, T, hidden] -> Q, K, V [B, H(_kv), T, D], unrotated
    scale: Callable[[Any], float]
    output: Callable[[Any, torch.Tensor, tuple[Any, ...], dict[str, Any]], Any]
    attention: str  # class name of the attention modules
    projection: str  # the fused Q/K/V projection (its in_features: the hidden size)
    rotate: Callable[[Any, _QKV, dict[str, Any]], _QKV] | None = None  # rotary position of the layer's call

    def qkv(self, module: Any, hidden: torch.Tensor, kwargs: dict[str, Any]) -> _QKV:
        """Q, K, V [B, H(_kv), T, D] of `module` for `hidden` [B, T, hidden], as its forward computes them."""
        qkv = self.split(module, hidden)
        return qkv if self.rotate is None else self.rotate(module, qkv, kwargs)


def _heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """[B, T, heads * dim] -> [B, heads, T, dim]."""
    return x.reshape(x.shape[0], x.shape[1], heads, dim).transpose(1, 2)


def _bloom_split(m: Any, hidden: torch.Tensor) -> _QKV:
    q, k, v = m._reshape(m.query_key_value(hidden))  # [B, H, T, D] each
    return q, k, v


def _bloom_output(m: Any, out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from transformers.models.bloom.modeling_bloom import dropout_add

    residual = args[1] if len(args) > 1 else kwargs["residual"]
    return dropout_add(m.dense(out), residual, m.hidden_dropout, m.training), None


def _mpt_split(m: Any, hidden: torch.Tensor) -> _QKV:
    mixed = m.Wqkv(hidden)
    if m.clip_qkv:
        mixed = mixed.clamp(min=-m.clip_qkv, max=m.clip_qkv)
    q, k, v = mixed.chunk(3, dim=2)
    return _heads(q, m.n_heads, m.head_dim), _heads(k, m.n_heads, m.head_dim), _heads(v, m.n_heads, m.head_dim)


def _falcon_split(m: Any, hidden: torch.Tensor) -> _QKV:
    fused = m.query_key_value(hidden)
    b, t, _ = fused.shape
    if m.new_decoder_architecture:  # K/V heads stored once, not broadcast to the query heads
        qkv = fused.view(b, t, -1, m.num_heads // m.num_kv_heads + 2, m.head_dim)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        q, k, v = m._split_heads(fused)  # [B, T, H(_kv), D]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(_kv), T, D]


def _falcon_rotate(m: Any, qkv: _QKV, kwargs: dict[str, Any]) -> _QKV:
    q, k, v = qkv
    if kwargs.get("alibi") is None:  # rotary Falcon: cos/sin of the engine's position_ids
        from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

        cos, sin = kwargs["position_embeddings"]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _dense_output(name: str) -> Callable[[Any, torch.Tensor, tuple[Any, ...], dict[str, Any]], Any]:
    def output(m: Any, out: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return getattr(m, name)(out), None

    return output


_SPECS: dict[str, _Spec] = {
    "bloom": _Spec(_bloom_split, lambda m: float(m.inv_norm_factor), _bloom_output, "BloomAttention",
                   "query_key_value"),
    "mpt": _Spec(_mpt_split, lambda m: float(m.softmax_scale), _dense_output("out_proj"), "MptAttention", "Wqkv"),
    "falcon": _Spec(_falcon_split, lambda m: float(m.inv_norm_factor), _dense_output("dense"), "FalconAttention",
                    "query_key_value", _falcon_rotate),
}  # fmt: skip
WRAPPED_TYPES = tuple(_SPECS)


def wrapped_type(config: Any) -> str | None:
    """The model type when this module serves it by wrapping its attention modules (Bloom, MPT, Falcon with
    or without ALiBi), else None."""
    model_type = getattr(config, "model_type", None)
    return str(model_type) if model_type in _SPECS else None


def kv_shape(config: Any) -> tuple[int, int]:
    """(K/V heads, head size) the pages hold for an ALiBi model, as its config describes it (`observe` has what
    the modules compute)."""
    heads = config.num_attention_heads
    head = config.hidden_size // heads
    if config.model_type == "falcon":
        if config.new_decoder_architecture:
            return config.num_kv_heads, head
        return (1 if config.multi_query else heads), head
    return heads, head


def observe(model: torch.nn.Module) -> dict[int, tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """Layer index -> the (heads, size) of the query, key and value each wrapped attention module of `model`
    computes (what its wrapper stores and attends with), from its own projection of one zero hidden state.
    Reads the weights only; changes nothing."""
    spec = _SPECS[str(wrapped_type(model.config))]
    out = {}
    with torch.inference_mode():
        for position, module in enumerate(m for m in model.modules() if type(m).__name__ == spec.attention):
            projection = getattr(module, spec.projection)
            weight = projection.weight
            hidden = torch.zeros((1, 1, projection.in_features), dtype=weight.dtype, device=weight.device)
            q, k, v = spec.split(module, hidden)  # [1, H(_kv), 1, D]
            idx = getattr(module, "layer_idx", None)
            layer = idx if isinstance(idx, int) else position
            out[layer] = ((q.shape[1], q.shape[3]), (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]))
    return out


def slopes(model: torch.nn.Module) -> torch.Tensor | None:
    """float32 [H_q]: each query head's ALiBi slope in pagedkv's convention (``slope * (k - q)`` added to
    the scaled logit), from the model's own slope function; None for a model without ALiBi (rotary Falcon)."""
    config: Any = model.config
    if config.model_type == "falcon" and not config.alibi:
        return None
    heads = config.num_attention_heads
    device = next(model.parameters()).device
    if config.model_type == "bloom":
        from transformers.models.bloom import modeling_bloom

        return modeling_bloom._get_alibi_slopes(heads, device).float()  # [H]
    if config.model_type == "mpt":
        from transformers.models.mpt import modeling_mpt

        bias = modeling_mpt.build_mpt_alibi_tensor(heads, 2, device=device).float()  # [H, 1, 2]
        return (bias[:, 0, 1] - bias[:, 0, 0]).reshape(heads)
    from transformers.models.falcon import modeling_falcon

    ones = torch.ones((1, 2), dtype=torch.long, device=device)
    bias = modeling_falcon.build_alibi_tensor(ones, heads, torch.float32)  # [H, 1, 2]: slope * (0, 1)
    twice = 2.0 if config._attn_implementation == "eager" else 1.0  # eager adds it again through the mask
    return bias[:, 0, 1] * (twice / math.sqrt(config.hidden_size // heads))  # [H]


def install(model: torch.nn.Module, pagedkv_attention: Callable[..., Any]) -> None:
    """Wrap the forward of every attention module of an ALiBi model (idempotent); see the module doc.
    `pagedkv_attention` is `pagedkv.hf.attention.pagedkv_attention` (passed in: this module is below it)."""
    from pagedkv.hf.context import ATTENTION_NAME, current

    spec = _SPECS[str(wrapped_type(model.config))]
    for module in model.modules():
        if type(module).__name__ != spec.attention or getattr(module, "_pagedkv_original", None) is not None:
            continue
        original = module.forward

        def forward(*args: Any, _m: Any = module, _orig: Any = original, **kwargs: Any) -> Any:
            ctx = kwargs.pop(ATTENTION_NAME, None) or current()
            if ctx is None:
                return _orig(*args, **kwargs)
            hidden = args[0] if args else kwargs["hidden_states"]  # [1, T, hidden]
            q, k, v = spec.qkv(_m, hidden, kwargs)  # [1, H(_kv), T, D]
            named: dict[str, Any] = {ATTENTION_NAME: ctx}
            out, _ = pagedkv_attention(_m, q, k, v, None, scaling=spec.scale(_m), **named)
            return spec.output(_m, out.reshape(hidden.shape[0], hidden.shape[1], -1), args, kwargs)

        setattr(module, "_pagedkv_original", original)  # noqa: B010 (marks the module as wrapped)
        setattr(module, "forward", forward)  # noqa: B010
