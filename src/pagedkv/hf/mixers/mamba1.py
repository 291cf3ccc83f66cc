"""Mamba1 (selective scan) mixers over state slots: transformers' `MambaMixer` and `JambaMambaMixer`.

Both mixers run, per token of a request (I = intermediate size, N = state size, R = dt rank,
K = conv kernel width)::

    x, z = in_proj(h).chunk(2)                       # [I] each; z is the gate
    x = act(conv1d(x))                               # causal depthwise conv over the request's x (K taps)
    dt, B, C = x_proj(x).split([R, N, N])
    dt, B, C = norm_dt(dt), norm_b(B), norm_c(C)     # Jamba only: RMSNorms (identity for Mamba)
    dt = dt_proj.weight @ dt                         # [I]; dt_proj's bias is added inside the scan
    y = selective_scan(x, dt, A=-exp(A_log), B, C, D, z, delta_bias=dt_proj.bias, softplus)
    out = out_proj(y)

The layer's state is two tensors per slot: the conv window ``(I, K - 1)`` (the last K - 1 conv
*inputs* x, oldest first, model dtype; `pagedkv.ops.conv_state`) and the SSM state ``(I, N)`` in
float32 (`pagedkv.ops.selective_scan`). The adapter's forward runs the projections once over all T
packed rows; only the ops see the request boundaries.

transformers' multi-token call on a non-empty cache restarts the SSM state at zero (its torch scan
takes no initial state), so chunked prefill there is not a reference; this forward continues the
state, and equals the module's cache-free forward over each request's whole sequence.

Config fields that change the math, all read through the module: ``use_conv_bias`` /
``mamba_conv_bias`` (conv bias or None), ``use_bias`` / ``mamba_proj_bias`` (in/out projection
biases, carried by the Linear modules), ``time_step_rank`` / ``mamba_dt_rank`` (R), ``hidden_act``
(the conv activation; the gate is always silu), Jamba's ``rms_norm_eps`` (in its norms).
``use_mambapy`` / ``use_associative_scan`` only pick transformers' scan algorithm. The
``attention_mask`` of transformers' forward zeroes padding rows; a packed ragged batch has none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pagedkv.hf.mixers.base import ForwardFn, MixerAdapter, StateBatch, module_attr
from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.selective_scan import selective_scan

__all__ = ["ADAPTERS", "mamba1_forward", "mamba1_state_spec", "identity_norms", "jamba_norms"]


NormsFn = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
"""(module, dt [T, R], B [T, N], C [T, N]) -> the same three after the mixer's own normalisation."""


def mamba1_state_spec(
    module: nn.Module, model_dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """One layer's state: conv window ``(I, K - 1)`` in `model_dtype`, SSM state ``(I, N)`` in float32."""
    conv_weight = module_attr(module, "conv1d", nn.Conv1d).weight  # [I, 1, K]
    a_log = module_attr(module, "A_log", torch.Tensor)  # [I, N]
    inner, kernel = conv_weight.shape[0], conv_weight.shape[-1]
    return ((inner, kernel - 1), (inner, a_log.shape[1])), (model_dtype, torch.float32)


def identity_norms(
    module: nn.Module, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`MambaMixer`: dt, B and C go to the scan as x_proj gives them."""
    return dt, b, c


def jamba_norms(
    module: nn.Module, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`JambaMambaMixer`: RMSNorms over dt [T, R] (before dt_proj), B [T, N] and C [T, N]."""
    return (
        module_attr(module, "dt_layernorm", nn.Module)(dt),
        module_attr(module, "b_layernorm", nn.Module)(b),
        module_attr(module, "c_layernorm", nn.Module)(c),
    )


def mamba1_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    batch: StateBatch,
    states: tuple[torch.Tensor, ...],
    norms: NormsFn = identity_norms,
) -> torch.Tensor:
    """A Mamba1 mixer over one step's packed ragged batch; see the module docstring for the math.

    Args:
        module: a `MambaMixer` or `JambaMambaMixer` (its weights and settings are read, its forward not run).
        hidden_states: [1, T, D], request b's rows ``batch.input_row_offsets[b]:[b + 1]``.
        batch: the step's requests, slots and has_state.
        states: (conv [num_slots, I, W >= K - 1] in the model dtype, ssm [num_slots, I, N] float32),
            the layer's tensors of `mamba1_state_spec`.
        norms: the mixer's normalisation of dt, B, C (`identity_norms`, `jamba_norms`).

    Returns [1, T, D] in the dtype of `hidden_states`. Each request continues from its slots when
    ``has_state[b]`` (else from zeros, the slots unread) and leaves its new states there; every
    other slot is left bit-identical. Raises ValueError on a batch that does not match T.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be [1, T, D], got {tuple(hidden_states.shape)}")
    if sum(batch.lengths) != hidden_states.shape[1]:
        raise ValueError(f"the batch has {sum(batch.lengths)} rows, hidden_states {hidden_states.shape[1]}")
    if len(states) != 2:
        raise ValueError(f"a Mamba1 layer has 2 state tensors (conv, ssm), got {len(states)}")
    conv_state, ssm_state = states
    conv1d = module_attr(module, "conv1d", nn.Conv1d)
    dt_proj = module_attr(module, "dt_proj", nn.Linear)
    rank = module_attr(module, "time_step_rank", int)
    n = module_attr(module, "ssm_state_size", int)
    activation = module_attr(module, "activation", str)

    projected = module_attr(module, "in_proj", nn.Module)(hidden_states[0])  # [T, 2I]
    x, gate = projected.chunk(2, dim=-1)  # [T, I] each
    fused = "silu" if activation == "silu" else None
    x = causal_conv1d(
        x, conv_state, conv1d.weight[:, 0, :], conv1d.bias, batch.slots, batch.has_state, batch.input_row_offsets,
        activation=fused, decode=batch.decode,
    )  # fmt: skip  # [T, I]
    if fused is None:
        x = module_attr(module, "act", nn.Module)(x)  # [T, I]
    dt, b, c = torch.split(module_attr(module, "x_proj", nn.Module)(x), [rank, n, n], dim=-1)  # [T, R], [T, N], [T, N]
    dt, b, c = norms(module, dt, b, c)
    dt = F.linear(dt, dt_proj.weight)  # [T, I], bias left to the scan (as transformers does)
    a = -torch.exp(module_attr(module, "A_log", torch.Tensor).float())  # [I, N]
    y = selective_scan(
        x, dt, a, b, c, ssm_state, batch.slots, batch.has_state, batch.scan_offsets,
        d=module_attr(module, "D", torch.Tensor), z=gate, delta_bias=dt_proj.bias, delta_softplus=True,
    )  # fmt: skip  # [T, I]
    out: torch.Tensor = module_attr(module, "out_proj", nn.Module)(y.to(hidden_states.dtype))  # [T, D]
    return out[None]  # [1, T, D]


def _forward_with(norms: NormsFn) -> ForwardFn:
    """`mamba1_forward` with the mixer's `norms` bound."""

    def forward(
        module: nn.Module, hidden_states: torch.Tensor, batch: StateBatch, states: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        return mamba1_forward(module, hidden_states, batch, states, norms)

    return forward


ADAPTERS: dict[str, MixerAdapter] = {
    "MambaMixer": MixerAdapter("mamba1", mamba1_state_spec, _forward_with(identity_norms)),
    "JambaMambaMixer": MixerAdapter("mamba1", mamba1_state_spec, _forward_with(jamba_norms)),
}
"""transformers class name -> its adapter."""
