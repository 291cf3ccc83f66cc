"""Mamba1's selective scan (the S6 SSM) over a ragged batch, with the recurrent state in slots.

Each request keeps a fixed-size state ``h [D_inner, N]`` in a state slot. Per token, with the
conventions of transformers' torch ``mamba_selective_scan`` / ``mamba_selective_state_update``
(``models/mamba``; the ``selective_scan_fn`` / ``selective_state_update`` of mamba_ssm)::

    dt = softplus(dt + delta_bias)          # bias only if given, softplus only with delta_softplus
    h = exp(dt[:, None] * A) * h + (dt[:, None] * B[None, :]) * x[:, None]
    y = h @ C + D * x                       # D skip only if given
    y = y * silu(z)                         # gate only if given

The op is the scan only: the causal conv (`pagedkv.ops.conv_state`), ``x_proj`` and the
``dt_proj`` weight run before it, ``out_proj`` after; ``dt_proj``'s bias and the softplus may be
left to the op (``delta_bias``, ``delta_softplus``) as transformers' MambaMixer does. The arguments
are named after Mamba's lowercased: ``a, b, c, d`` are its ``A, B, C, D``, with ``A = -exp(A_log)``
already taken. All math runs in float32; the output comes back in ``x``'s dtype, the state stays
float32.

Shapes (the ragged layout of the engine: request r owns rows
``input_row_offsets[r]:input_row_offsets[r + 1]``)::

    x, dt [T, D_inner]; a [D_inner, N]; b, c [T, N]; d, delta_bias [D_inner]; z [T, D_inner]
    state [num_slots, D_inner, N] float32; slots int [B] (distinct); has_state bool [B]
    input_row_offsets int [B + 1]; output [T, D_inner]

`selective_scan_reference` is the slow source of truth (Python loop over requests and tokens);
`selective_scan` is the vectorised path: requests sorted by length, one batched recurrent step per
token position over the requests that still have a token there (the Mamba1 decay is per channel
and state entry, so a chunked form would need ``[C, C, D_inner, N]`` decays per chunk; the step
loop keeps memory at the state's size and the arithmetic of the reference). Both write each
request's final state into its slot and leave every other slot untouched.
"""

from __future__ import annotations

import torch

from pagedkv.ops.state_slots import initial_states

__all__ = ["selective_scan", "selective_scan_reference"]


def _check(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    d: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the arguments have the shapes and dtypes of the module contract."""
    if x.dim() != 2 or dt.shape != x.shape:
        raise ValueError(f"x/dt must be [T, D_inner] alike, got {tuple(x.shape)} and {tuple(dt.shape)}")
    t, d_inner = x.shape
    if a.dim() != 2 or a.shape[0] != d_inner:
        raise ValueError(f"a must be [D_inner={d_inner}, N], got {tuple(a.shape)}")
    n = a.shape[1]
    if b.shape != (t, n) or c.shape != (t, n):
        raise ValueError(f"b/c must be [T, N]={t, n}, got {tuple(b.shape)} and {tuple(c.shape)}")
    for name, vec in (("d", d), ("delta_bias", delta_bias)):
        if vec is not None and vec.shape != (d_inner,):
            raise ValueError(f"{name} must be [D_inner]=({d_inner},), got {tuple(vec.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must be [T, D_inner]={t, d_inner}, got {tuple(z.shape)}")
    if state.dim() != 3 or state.shape[1:] != (d_inner, n) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [slots, {d_inner}, {n}], got {state.dtype} {tuple(state.shape)}")
    batch = slots.shape[0]
    if slots.dim() != 1 or slots.is_floating_point() or has_state.shape != (batch,) or has_state.dtype != torch.bool:
        raise ValueError("slots must be int [B] and has_state bool [B]")
    if input_row_offsets.shape != (batch + 1,) or input_row_offsets.is_floating_point():
        raise ValueError(f"input_row_offsets must be int [B + 1] = [{batch + 1}], got {tuple(input_row_offsets.shape)}")


def _prepare(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 x, dt (biased and softplus'd as asked), a, b, c."""
    x32, dt32, a32, b32, c32 = (v.to(torch.float32) for v in (x, dt, a, b, c))
    if delta_bias is not None:
        dt32 = dt32 + delta_bias.to(torch.float32)  # [T, D_inner]
    if delta_softplus:
        dt32 = torch.nn.functional.softplus(dt32)  # [T, D_inner]
    return x32, dt32, a32, b32, c32


def _finish(
    y: torch.Tensor, x: torch.Tensor, x32: torch.Tensor, d: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """The D skip and the z gate on the scan output y [T, D_inner] (float32); cast to x's dtype."""
    if d is not None:
        y = y + x32 * d.to(torch.float32)  # [T, D_inner]
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(torch.float32))  # [T, D_inner]
    return y.to(x.dtype)


def selective_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    d: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> torch.Tensor:
    """The selective scan, one request and one token at a time (slow, obviously correct).

    Shapes as the module docstring. Returns ``y [T, D_inner]`` in x's dtype. Side effect:
    ``state[slots[r]]`` holds request r's final state (its stored state when ``has_state[r]``,
    else zeros, advanced over its tokens); other slots are untouched.
    """
    _check(x, dt, a, b, c, state, slots, has_state, input_row_offsets, d, z, delta_bias)
    x32, dt32, a32, b32, c32 = _prepare(x, dt, a, b, c, delta_bias, delta_softplus)
    offsets = input_row_offsets.tolist()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D_inner]
    for r, slot in enumerate(slots.tolist()):
        h = state[slot].clone() if bool(has_state[r]) else torch.zeros_like(state[slot])  # [D_inner, N]
        for t in range(offsets[r], offsets[r + 1]):
            decay = torch.exp(dt32[t][:, None] * a32)  # [D_inner, N]
            h = decay * h + (dt32[t][:, None] * b32[t][None, :]) * x32[t][:, None]  # [D_inner, N]
            y[t] = h @ c32[t]  # [D_inner]
        state[slot] = h
    return _finish(y, x, x32, d, z)


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    d: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
) -> torch.Tensor:
    """The selective scan over a ragged batch, vectorised; same contract as `selective_scan_reference`.

    Requests are sorted by length (longest first); step j updates, in one batched recurrent step,
    the states of the requests with more than j tokens (a prefix of that order). Decode batches
    are one step. Reads ``input_row_offsets`` on the host once. Returns ``y [T, D_inner]`` in x's
    dtype; writes each request's final state to ``state[slots[r]]`` (zero-token requests get their
    initial state: stored or zeros); other slots are untouched.
    """
    _check(x, dt, a, b, c, state, slots, has_state, input_row_offsets, d, z, delta_bias)
    x32, dt32, a32, b32, c32 = _prepare(x, dt, a, b, c, delta_bias, delta_softplus)
    offsets = input_row_offsets.tolist()
    lengths = [offsets[r + 1] - offsets[r] for r in range(len(offsets) - 1)]
    device = x.device
    y = torch.zeros(x.shape, dtype=torch.float32, device=device)  # [T, D_inner]
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    sorted_lengths = [lengths[r] for r in order]
    order_t = torch.tensor(order, dtype=torch.long, device=device)  # [B]
    starts = torch.tensor([offsets[r] for r in order], dtype=torch.long, device=device)  # [B]
    h = initial_states(state, slots[order_t], has_state[order_t])  # [B, D_inner, N] in length order
    for j in range(sorted_lengths[0] if sorted_lengths else 0):
        active = sum(1 for n in sorted_lengths if n > j)
        rows = starts[:active] + j  # [A] token j of each request still running
        dt_j, x_j = dt32[rows], x32[rows]  # [A, D_inner]
        decay = torch.exp(dt_j[:, :, None] * a32[None])  # [A, D_inner, N]
        h_a = decay * h[:active] + (dt_j[:, :, None] * b32[rows][:, None, :]) * x_j[:, :, None]  # [A, D_inner, N]
        h[:active] = h_a
        y[rows] = (h_a @ c32[rows][:, :, None])[..., 0]  # [A, D_inner]
    state[slots.long()[order_t]] = h
    return _finish(y, x, x32, d, z)
