"""LFM2's gated short convolution over state slots: transformers' `Lfm2ShortConv` and its copies.

Per token of a request (D = hidden size, K = ``conv_L_cache``)::

    B, C, x = in_proj(h).chunk(3)     # [D] each
    u = conv(B * x)                   # causal depthwise conv over the request's B*x (K taps, no activation)
    out = out_proj(C * u)

The layer's state is one tensor per slot: the conv window ``(D, K - 1)`` of the last K - 1 conv
*inputs* ``B * x``, oldest first, in the model dtype (`pagedkv.ops.conv_state`). The projections
run once over all T packed rows; only the conv sees the request boundaries.

`Lfm2MoeShortConv` (lfm2_moe) and `Lfm3ShortConv` (lfm3) are the same module, line for line, and
share the adapter. ``conv_bias`` is the one config field that changes the math (bias on in_proj,
conv and out_proj, carried by the modules). The ``attention_mask`` of transformers' forward zeroes
padding rows; a packed ragged batch has none.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.hf.mixers.base import MixerAdapter, StateBatch, module_attr
from pagedkv.ops.conv_state import causal_conv1d

__all__ = ["ADAPTERS", "short_conv_forward", "short_conv_state_spec"]


def short_conv_state_spec(
    module: nn.Module, model_dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """One layer's state: the conv window ``(D, K - 1)`` in `model_dtype`."""
    weight = module_attr(module, "conv", nn.Conv1d).weight  # [D, 1, K]
    return ((weight.shape[0], weight.shape[-1] - 1),), (model_dtype,)


def short_conv_forward(
    module: nn.Module, hidden_states: torch.Tensor, batch: StateBatch, states: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """The short conv over one step's packed ragged batch; see the module docstring for the math.

    Args:
        module: an `Lfm2ShortConv` (or copy; its weights are read, its forward not run).
        hidden_states: [1, T, D], request b's rows ``batch.input_row_offsets[b]:[b + 1]``.
        batch: the step's requests, slots and has_state.
        states: (conv [num_slots, D, W >= K - 1] in the model dtype,), as `short_conv_state_spec` says.

    Returns [1, T, D] in the dtype of `hidden_states`. Each request continues from its slot when
    ``has_state[b]`` (else from zeros, the slot unread) and leaves its last inputs there; every
    other slot is left bit-identical. Raises ValueError on a batch that does not match T.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be [1, T, D], got {tuple(hidden_states.shape)}")
    if sum(batch.lengths) != hidden_states.shape[1]:
        raise ValueError(f"the batch has {sum(batch.lengths)} rows, hidden_states {hidden_states.shape[1]}")
    if len(states) != 1:
        raise ValueError(f"a short conv layer has 1 state tensor (conv), got {len(states)}")
    conv = module_attr(module, "conv", nn.Conv1d)
    b, c, x = module_attr(module, "in_proj", nn.Module)(hidden_states[0]).chunk(3, dim=-1)  # [T, D] each
    u = causal_conv1d(
        b * x,
        states[0],
        conv.weight[:, 0, :],
        conv.bias,
        batch.slots,
        batch.has_state,
        batch.input_row_offsets,
        decode=batch.decode,
    )  # [T, D]
    out: torch.Tensor = module_attr(module, "out_proj", nn.Module)(c * u)  # [T, D]
    return out[None]  # [1, T, D]


_ADAPTER = MixerAdapter("short_conv", short_conv_state_spec, short_conv_forward)

ADAPTERS: dict[str, MixerAdapter] = {
    "Lfm2ShortConv": _ADAPTER,
    "Lfm2MoeShortConv": _ADAPTER,
    "Lfm3ShortConv": _ADAPTER,
}
"""transformers class name -> its adapter."""
