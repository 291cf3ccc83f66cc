"""Gated delta net mixers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid) over state slots.

The three transformers modules run the same math and differ only in how they
project the input and what they name their output norm and projection:

1. projections of every packed row: the conv input ``q | k | v`` (``conv_dim = 2 * H_k * Dk + H_v * Dv``
   channels), the output gate ``z [T, H_v, Dv]``, ``beta = sigmoid(b) [T, H_v]`` (x2 in OLMo-hybrid when
   ``linear_allow_neg_eigval``) and ``a [T, H_v]``;
2. a depthwise causal conv of kernel K over ``q | k | v`` with the module's activation (silu), continuing each
   request's conv state (`pagedkv.ops.causal_conv1d`);
3. the gated delta rule with log decay ``g = -exp(A_log) * softplus(a + dt_bias)``, l2-normalised q and k,
   key heads repeated to the value heads, continuing each request's recurrent state
   (`pagedkv.ops.gated_delta_rule`, 64-token chunks for prefill as transformers);
4. the gated RMSNorm ``norm(o, z)`` per value head, then the output projection.

State of one layer, in the order `forward` reads them (shapes exclude the slot dimension)::

    conv       [conv_dim, K - 1]   model dtype   the last K - 1 conv inputs (q | k | v), oldest first
    recurrent  [H_v, Dk, Dv]       float32       S of the delta rule (transformers' layout; vLLM stores [H_v, Dv, Dk])

OLMo-hybrid has one depthwise conv over the concatenated ``q | k | v`` (one `conv1d` module, as the Qwen
models), so its conv state is a single tensor too. transformers keeps K conv columns; the conv only reads
K - 1, which is what a slot stores here.

Nothing here reads an attention mask: a packed ragged batch has no padding rows, so transformers'
``apply_mask_to_padding_states`` has nothing to zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.hf.mixers.base import MixerAdapter, StateBatch
from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.gated_delta import gated_delta_rule

__all__ = ["ADAPTERS", "GdnDims", "Projections", "gdn_dims"]

_SILU = ("silu", "swish")


@dataclass(frozen=True)
class GdnDims:
    """A gated delta net module's sizes: H_k key heads of Dk, H_v value heads of Dv, conv kernel K."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kernel_size: int

    @property
    def key_dim(self) -> int:
        """H_k * Dk: the q (and the k) channels of the conv input."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """H_v * Dv: the v channels of the conv input, and the width of the core output."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv input ``q | k | v``."""
        return 2 * self.key_dim + self.value_dim


def gdn_dims(module: nn.Module) -> GdnDims:
    """The sizes of a transformers gated delta net (the attributes all its classes set in ``__init__``);
    raises ValueError unless its ``conv1d`` is depthwise over ``q | k | v`` and H_v is a multiple of H_k."""
    weight_shape = tuple(_conv(module).weight.shape)  # (conv_dim, 1, K)
    dims = GdnDims(
        num_k_heads=int(_attr(module, "num_k_heads")),
        num_v_heads=int(_attr(module, "num_v_heads")),
        head_k_dim=int(_attr(module, "head_k_dim")),
        head_v_dim=int(_attr(module, "head_v_dim")),
        kernel_size=int(weight_shape[-1]),
    )
    if dims.num_v_heads % dims.num_k_heads:
        raise ValueError(f"value heads {dims.num_v_heads} must be a multiple of key heads {dims.num_k_heads}")
    if weight_shape != (dims.conv_dim, 1, dims.kernel_size):
        raise ValueError(f"conv1d weight {weight_shape} is not depthwise over the {dims.conv_dim} q|k|v channels")
    return dims


def _conv(module: nn.Module) -> nn.Conv1d:
    """The module's depthwise ``conv1d`` (its weight [conv_dim, 1, K] is read directly, as transformers does)."""
    conv = _attr(module, "conv1d")
    if not isinstance(conv, nn.Conv1d):
        raise TypeError(f"{type(module).__name__}.conv1d is {type(conv).__name__}, expected nn.Conv1d")
    return conv


def _attr(module: nn.Module, name: str) -> Any:
    """``module.<name>`` untyped (`nn.Module.__getattr__` types every attribute as ``Tensor | Module``)."""
    return getattr(module, name)


def _call(module: nn.Module, name: str, *args: torch.Tensor) -> Any:
    """``module.<name>(*args)``: a submodule (projection, norm) or method of the transformers module."""
    return _attr(module, name)(*args)


@dataclass(frozen=True)
class Projections:
    """What a gated delta net projects from the T packed rows (all in the model dtype).

    Attributes:
        mixed_qkv: [T, conv_dim] the conv input, channels ``q | k | v`` (heads contiguous within each).
        z: [T, H_v, Dv] the gate of the output norm.
        beta: [T, H_v] the delta rule's write strength (``sigmoid(b)``, doubled where the model allows
            negative eigenvalues).
        a: [T, H_v] the decay's input (``g = -exp(A_log) * softplus(a + dt_bias)``).
    """

    mixed_qkv: torch.Tensor
    z: torch.Tensor
    beta: torch.Tensor
    a: torch.Tensor


def _project_qwen3_next(module: nn.Module, hidden_states: torch.Tensor, dims: GdnDims) -> Projections:
    """Qwen3-Next: fused ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head; the module's own
    ``fix_query_key_value_ordering`` takes them apart. hidden_states [1, T, D]."""
    t = hidden_states.shape[1]
    qkvz = _call(module, "in_proj_qkvz", hidden_states)  # [1, T, 2*key_dim + 2*value_dim]
    ba = _call(module, "in_proj_ba", hidden_states)  # [1, T, 2*H_v]
    query, key, value, z, b, a = _call(module, "fix_query_key_value_ordering", qkvz, ba)
    mixed_qkv = torch.cat([query.reshape(t, -1), key.reshape(t, -1), value.reshape(t, -1)], dim=-1)  # [T, conv_dim]
    return Projections(
        mixed_qkv=mixed_qkv,
        z=z.reshape(t, dims.num_v_heads, dims.head_v_dim),  # [T, H_v, Dv]
        beta=b.reshape(t, dims.num_v_heads).sigmoid(),  # [T, H_v]
        a=a.reshape(t, dims.num_v_heads),  # [T, H_v]
    )


def _project_qwen3_5(module: nn.Module, hidden_states: torch.Tensor, dims: GdnDims) -> Projections:
    """Qwen3.5 (and Qwen3.5-MoE): separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    x = hidden_states[0]  # [T, D]
    return Projections(
        mixed_qkv=_call(module, "in_proj_qkv", x),  # [T, conv_dim]
        z=_call(module, "in_proj_z", x).reshape(-1, dims.num_v_heads, dims.head_v_dim),  # [T, H_v, Dv]
        beta=_call(module, "in_proj_b", x).sigmoid(),  # [T, H_v]
        a=_call(module, "in_proj_a", x),  # [T, H_v]
    )


def _project_olmo_hybrid(module: nn.Module, hidden_states: torch.Tensor, dims: GdnDims) -> Projections:
    """OLMo-hybrid: separate q/k/v/a/b projections, the gate from ``g_proj``, beta x2 with ``allow_neg_eigval``."""
    x = hidden_states[0]  # [T, D]
    mixed_qkv = torch.cat([_call(module, name, x) for name in ("q_proj", "k_proj", "v_proj")], dim=-1)  # [T, conv_dim]
    beta = _call(module, "b_proj", x).sigmoid()  # [T, H_v]
    if bool(_attr(module, "allow_neg_eigval")):
        beta = beta * 2.0  # [T, H_v] in (0, 2)
    return Projections(
        mixed_qkv=mixed_qkv,
        z=_call(module, "g_proj", x).reshape(-1, dims.num_v_heads, dims.head_v_dim),  # [T, H_v, Dv]
        beta=beta,
        a=_call(module, "a_proj", x),  # [T, H_v]
    )


@dataclass(frozen=True)
class _Family:
    """What differs between the gated delta net classes: the projections and two submodule names."""

    project: Callable[[nn.Module, torch.Tensor, GdnDims], Projections]
    norm: str  # the gated RMSNorm: norm(o [N, Dv], z [N, Dv]) -> [N, Dv]
    out_proj: str  # value_dim -> hidden


def state_spec(
    module: nn.Module, model_dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """(conv ``(conv_dim, K - 1)``, recurrent ``(H_v, Dk, Dv)``) shapes; dtypes (model dtype, float32)."""
    dims = gdn_dims(module)
    shapes = ((dims.conv_dim, dims.kernel_size - 1), (dims.num_v_heads, dims.head_k_dim, dims.head_v_dim))
    return shapes, (model_dtype, torch.float32)


def _conv_activation(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The module's conv activation (``config.hidden_act``) applied to ``y``, for the non-silu case."""
    from transformers.activations import ACT2FN

    out: torch.Tensor = ACT2FN[str(_attr(module, "activation"))](y)
    return out


def _forward(
    family: _Family,
    module: nn.Module,
    hidden_states: torch.Tensor,
    batch: StateBatch,
    states: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """The packed ragged forward of a gated delta net (see the module docstring).

    hidden_states [1, T, D] (request b owns rows ``input_row_offsets[b]:input_row_offsets[b + 1]``);
    states = (conv [num_slots, conv_dim, K - 1], recurrent [num_slots, H_v, Dk, Dv] float32), as `state_spec`.
    Returns [1, T, D] in the model dtype; writes each request's new states into ``states[i][slots[b]]`` and
    leaves every other slot bit-identical.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be [1, T, D], got {tuple(hidden_states.shape)}")
    if hidden_states.shape[1] != sum(batch.lengths):
        raise ValueError(f"hidden_states has {hidden_states.shape[1]} rows, the batch {sum(batch.lengths)}")
    if len(states) != 2:
        raise ValueError(f"a gated delta net layer has 2 state tensors (conv, recurrent), got {len(states)}")
    conv_state, recurrent_state = states
    dims = gdn_dims(module)
    t = hidden_states.shape[1]
    rows = (batch.slots, batch.has_state, batch.input_row_offsets)

    p = family.project(module, hidden_states, dims)
    conv = _conv(module)
    silu = _attr(module, "activation") in _SILU
    mixed_qkv = causal_conv1d(
        p.mixed_qkv,
        conv_state,
        conv.weight.squeeze(1),
        conv.bias,
        *rows,
        activation="silu" if silu else None,
        decode=batch.decode,
    )  # [T, conv_dim]
    if not silu:
        mixed_qkv = _conv_activation(module, mixed_qkv)  # [T, conv_dim]
    query, key, value = torch.split(mixed_qkv, [dims.key_dim, dims.key_dim, dims.value_dim], dim=-1)
    query = query.reshape(t, dims.num_k_heads, dims.head_k_dim)  # [T, H_k, Dk]
    key = key.reshape(t, dims.num_k_heads, dims.head_k_dim)  # [T, H_k, Dk]
    value = value.reshape(t, dims.num_v_heads, dims.head_v_dim)  # [T, H_v, Dv]

    a_log: torch.Tensor = _attr(module, "A_log")
    dt_bias: torch.Tensor = _attr(module, "dt_bias")
    g = -a_log.float().exp() * F.softplus(p.a.float() + dt_bias)  # [T, H_v] float32 log decay
    core = gated_delta_rule(
        query, key, value, g, p.beta, recurrent_state, batch.slots, batch.has_state, batch.scan_offsets,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip  # [T, H_v, Dv] model dtype

    normed = _call(module, family.norm, core.reshape(-1, dims.head_v_dim), p.z.reshape(-1, dims.head_v_dim))
    out: torch.Tensor = _call(module, family.out_proj, normed.reshape(1, t, dims.value_dim))  # [1, T, D]
    return out


def _adapter(family: _Family) -> MixerAdapter:
    """The `MixerAdapter` of one gated delta net class."""
    return MixerAdapter(mamba_type="gdn_attn", state_spec=state_spec, forward=partial(_forward, family))


_QWEN3_NEXT = _Family(project=_project_qwen3_next, norm="norm", out_proj="out_proj")
_QWEN3_5 = _Family(project=_project_qwen3_5, norm="norm", out_proj="out_proj")
_OLMO_HYBRID = _Family(project=_project_olmo_hybrid, norm="o_norm", out_proj="o_proj")

ADAPTERS: dict[str, MixerAdapter] = {
    "Qwen3NextGatedDeltaNet": _adapter(_QWEN3_NEXT),
    "Qwen3_5GatedDeltaNet": _adapter(_QWEN3_5),
    "Qwen3_5MoeGatedDeltaNet": _adapter(_QWEN3_5),  # the same class body as Qwen3_5GatedDeltaNet (modular copy)
    "OlmoHybridGatedDeltaNet": _adapter(_OLMO_HYBRID),
}
"""transformers class name -> its adapter."""
