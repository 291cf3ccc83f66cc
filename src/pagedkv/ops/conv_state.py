"""Causal depthwise conv1d over a ragged batch, with a rolling conv state per request.

Mamba, Mamba2, gated delta net (Qwen3-Next) and LFM2's short convs run a
depthwise causal conv of kernel size K over each request's tokens; the last
inputs of a request are cached between steps in a state slot so that the next
chunk (chunked prefill) or token (decode) sees its left context.

State convention (matches transformers' torch fallback
``causal_conv1d_update`` in ``models/{mamba2,qwen3_next,lfm2}``, and the
prefill padding of its ``LinearAttentionCacheLayer.update_conv_state``): a slot
holds the last ``W = conv_state.shape[-1]`` *inputs* of the request, oldest
first (``state[:, -1]`` is the most recent input), left-padded with zeros
when the request has seen fewer than ``W`` inputs. The new state is the last
``W`` columns of ``cat([old_state, x_request.T], dim=-1)``. The conv reads only
the last ``K - 1`` columns, so ``W = K - 1`` is the minimal state (vLLM's
layout); transformers allocates ``W = K`` and both are accepted here
(any ``W >= K - 1``).

Shapes: ``x [T, C]`` (request b owns rows ``input_row_offsets[b]:input_row_offsets[b + 1]``),
``conv_state [num_slots, C, W]``, ``slots [B]``, ``has_state [B]``,
``weight [C, K]`` (``weight[:, K - 1]`` multiplies the current token),
``bias [C] | None``. Arithmetic is float32 in both paths; the output is cast to
``x.dtype`` and the stored inputs to ``conv_state.dtype``.
"""

from __future__ import annotations

import torch

from pagedkv.ops.state_slots import initial_states

__all__ = ["causal_conv1d", "causal_conv1d_reference", "ACTIVATIONS"]

ACTIVATIONS = (None, "silu")


def _check(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    activation: str | None,
) -> None:
    """Shape/dtype checks only (no device sync)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"expected x [T, C], weight [C, K], conv_state [num_slots, C, W]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_state.shape)}"
        )
    channels, kernel_size = weight.shape
    if kernel_size < 1:
        raise ValueError("kernel_size must be >= 1")
    if x.shape[1] != channels or conv_state.shape[1] != channels:
        raise ValueError(f"channels differ: x {x.shape[1]}, weight {channels}, conv_state {conv_state.shape[1]}")
    if conv_state.shape[2] < kernel_size - 1:
        raise ValueError(f"conv_state width {conv_state.shape[2]} < kernel_size - 1 = {kernel_size - 1}")
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({channels},)")
    batch = input_row_offsets.shape[0] - 1
    if input_row_offsets.dim() != 1 or batch < 0:
        raise ValueError("input_row_offsets must be [B + 1]")
    if tuple(slots.shape) != (batch,) or tuple(has_state.shape) != (batch,):
        raise ValueError(f"slots {tuple(slots.shape)} and has_state {tuple(has_state.shape)} must be ({batch},)")
    if has_state.dtype != torch.bool:
        raise ValueError(f"has_state must be bool, got {has_state.dtype}")
    if slots.dtype.is_floating_point or input_row_offsets.dtype.is_floating_point:
        raise ValueError("slots and input_row_offsets must be integer tensors")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return torch.nn.functional.silu(y) if activation == "silu" else y


def causal_conv1d_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    activation: str | None = None,
) -> torch.Tensor:
    """Slow loop reference of `causal_conv1d`: one request, then one token, at a time.

    For request b with inputs ``x_b [n_b, C]`` and prior ``s_b [C, W]`` (``conv_state[slots[b]]``
    if ``has_state[b]`` else zeros), ``ext = cat([s_b, x_b.T], -1)  # [C, W + n_b]`` and token j gives
    ``sum_k weight[:, k] * ext[:, W + j - (K - 1) + k] + bias``, then the activation.

    Returns ``[T, C]`` in ``x.dtype``. Side effect: ``conv_state[slots[b]] = ext[:, -W:]`` for every
    request (also when ``n_b == 0``: the prior, i.e. zeros without state); other slots untouched.
    `slots` must be distinct.
    """
    _check(x, conv_state, weight, bias, slots, has_state, input_row_offsets, activation)
    slot_list = [int(s) for s in slots]
    if len(set(slot_list)) != len(slot_list):
        raise ValueError(f"slots must be distinct, got {slot_list}")
    channels, kernel_size = weight.shape
    width = conv_state.shape[2]
    w32 = weight.float()  # [C, K]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [T, C]
    offsets = [int(o) for o in input_row_offsets]
    new_states = []
    for b, slot in enumerate(slot_list):
        start, end = offsets[b], offsets[b + 1]
        if bool(has_state[b]):
            prior = conv_state[slot].float()  # [C, W]
        else:
            prior = torch.zeros(channels, width, dtype=torch.float32, device=x.device)  # [C, W]
        ext = torch.cat([prior, x[start:end].float().T], dim=-1)  # [C, W + n_b]
        for j in range(end - start):
            acc = torch.zeros(channels, dtype=torch.float32, device=x.device)  # [C]
            for k in range(kernel_size):
                acc = acc + w32[:, k] * ext[:, width + j - (kernel_size - 1) + k]
            if bias is not None:
                acc = acc + bias.float()
            out[start + j] = _activate(acc, activation)
        new_states.append((slot, ext[:, ext.shape[1] - width :]))  # [C, W]
    for slot, state in new_states:  # write after every read
        conv_state[slot] = state.to(conv_state.dtype)
    return out.to(x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    activation: str | None = None,
    *,
    decode: bool = False,
) -> torch.Tensor:
    """Causal depthwise conv1d over the ragged batch `x`, continuing each request's conv state.

    Same contract as `causal_conv1d_reference`: returns ``[T, C]`` in ``x.dtype``; updates
    ``conv_state[slots[b]]`` to the last ``W`` inputs of request b (its prior state included when
    it has fewer than ``W`` new tokens; zeros instead of the prior where ``has_state[b]`` is False);
    every other slot is left bit-identical. `slots` must be distinct (not checked: that would sync).

    Vectorised with no loop over requests and no host sync: the new inputs and each request's
    prior state are stacked into one source ``[T + B * W, C]``; every token gathers its K-wide
    window from it (``[T, K, C]``) and every request its new state (``[B, W, C]``).

    `decode`: the caller promises one token per request (request b owns row b, as in a decode step);
    the window is then the prior state's last ``K - 1`` inputs and the token, with no index building.
    ValueError when `x` does not have one row per request.
    """
    _check(x, conv_state, weight, bias, slots, has_state, input_row_offsets, activation)
    num_tokens, channels = x.shape
    kernel_size = weight.shape[1]
    width = conv_state.shape[2]
    batch = slots.shape[0]
    device = x.device
    if decode:
        if num_tokens != batch:
            raise ValueError(f"decode=True needs one token per request: x has {num_tokens} rows for {batch} requests")
        return _decode(x, conv_state, weight, bias, slots, has_state, activation)
    offsets = input_row_offsets.to(device=device, dtype=torch.long)  # [B + 1]
    starts = offsets[:-1]  # [B]
    lengths = offsets[1:] - starts  # [B]
    slot_idx = slots.to(device=device, dtype=torch.long)  # [B]

    prior = initial_states(conv_state, slot_idx, has_state.to(device)).float()  # [B, C, W], zeros without state
    source = torch.cat([x.float(), prior.transpose(1, 2).reshape(batch * width, channels)])  # [T + B*W, C]

    def source_rows(request: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        """Row in `source` of position `rel` relative to the request's first new token
        (``rel < 0`` reaches into its prior state, ``rel >= -W`` always)."""
        in_x = starts[request] + rel.clamp(min=0)
        in_state = num_tokens + request * width + (width + rel).clamp(min=0)
        return torch.where(rel >= 0, in_x, in_state)

    # Output: token t of request r at local position j reads positions j - (K - 1) .. j.
    request = torch.repeat_interleave(torch.arange(batch, device=device), lengths, output_size=num_tokens)  # [T]
    local = torch.arange(num_tokens, device=device) - starts[request]  # [T]
    taps = torch.arange(kernel_size, device=device) - (kernel_size - 1)  # [K]
    rows = source_rows(request[:, None], local[:, None] + taps[None, :])  # [T, K]
    windows = source[rows]  # [T, K, C]
    y = (windows * weight.float().T[None]).sum(dim=1)  # [T, C]
    if bias is not None:
        y = y + bias.float()  # [T, C]
    y = _activate(y, activation)  # [T, C]

    # New state: positions n_b - W .. n_b - 1 of each request (negative ones come from the prior).
    batch_idx = torch.arange(batch, device=device)  # [B]
    state_rel = lengths[:, None] - width + torch.arange(width, device=device)[None, :]  # [B, W]
    new_state = source[source_rows(batch_idx[:, None], state_rel)]  # [B, W, C]
    conv_state.index_copy_(0, slot_idx, new_state.transpose(1, 2).to(conv_state.dtype))  # [B, C, W]
    return y.to(x.dtype)


def _decode(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """`causal_conv1d` for one token per request (row b is request b's token)."""
    kernel_size, width = weight.shape[1], conv_state.shape[2]
    slot_idx = slots.to(device=x.device, dtype=torch.long)  # [B]
    prior = initial_states(conv_state, slot_idx, has_state.to(x.device)).float()  # [B, C, W]
    inputs = torch.cat([prior, x.float()[:, :, None]], dim=2)  # [B, C, W + 1], oldest first
    y = (inputs[:, :, width + 1 - kernel_size :] * weight.float()[None]).sum(dim=2)  # [B, C]
    if bias is not None:
        y = y + bias.float()  # [B, C]
    conv_state.index_copy_(0, slot_idx, inputs[:, :, 1:].to(conv_state.dtype))  # [B, C, W]
    return _activate(y, activation).to(x.dtype)
