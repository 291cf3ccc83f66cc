# ruff: noqa: N803 - A, B, C, D are the SSM parameters as Mamba2 (paper and transformers) spells them
"""Mamba2's SSD (state space duality) scan over a ragged batch, with a state slot per request.

Each request keeps a fixed-size recurrent state ``h [H, P, N]`` in a state slot. Per token, per head,
with the conventions of transformers' Mamba2 torch path (``mamba2_chunk_scan`` for prefill,
``mamba2_selective_state_update`` for decode, as ``Mamba2Mixer.forward`` calls them)::

    dt = clamp(softplus(dt + dt_bias), *time_step_limit)   # softplus only with dt_softplus (Mamba2: always)
    h = exp(dt * A) h + dt * x ⊗ B                         # A [H] negative (-exp(A_log)); x [P], B [N]
    y = h · C + D x                                        # contraction over the state N; D [H] skip

Groups as transformers: with ``H = r * G`` heads share B and C in consecutive runs of ``r``
(``repeat_interleave``). The inputs are those after the conv (x, B, C) and before the gated norm;
the gate ``z`` is not applied here. All math runs in float32; the output comes back in x's dtype,
the state stays float32. The ``time_step_limit`` clamp applies to every token: transformers' torch
decode step does not clamp, which is the same for the default limit ``(0, inf)`` (softplus is
positive) and for any limit the step's dt already lies in.

Shapes (the ragged layout of the engine: request b owns rows
``input_row_offsets[b]:input_row_offsets[b + 1]``)::

    x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; D [H] | None; dt_bias [H] | None
    state [num_slots, H, P, N] float32; slots int [B] (distinct); has_state bool [B]
    input_row_offsets int [B + 1]; output [T, H, P]

`ssd_reference` is the slow source of truth (Python loop over requests and tokens); `ssd_scan` is
the vectorised path: one-token requests take the recurrent step batched over requests, longer ones
the chunked form of ``mamba2_chunk_scan`` (intra-chunk quadratic form with ``exp(segment_sum)``,
chunk states, then the scan over chunk index) with every chunk of every request computed at once
and the scan over chunk index batched over requests. Both write each request's final state into its
slot and leave every other slot untouched.
"""

from __future__ import annotations

import math

import torch

from pagedkv.ops.state_slots import ChunkLayout, initial_states

__all__ = ["segment_sum", "ssd_reference", "ssd_scan"]

DEFAULT_TIME_STEP_LIMIT = (0.0, math.inf)


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., C] -> [..., C, C]``: ``out[..., l, s] = sum(x[..., s + 1 : l + 1])`` for ``s <= l``, -inf above.

    transformers' stable form (masked cumulative sum, no difference of cumsums), so ``exp`` of it is
    the decay from position s to l within a chunk.
    """
    c = x.shape[-1]
    expanded = x[..., None].expand(*x.shape, c)  # [..., C(l), C(s)] holding x[l]
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)
    summed = expanded.masked_fill(~strictly_lower, 0).cumsum(dim=-2)  # [..., C, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(0)
    return summed.masked_fill(~lower, -torch.inf)


def _check(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    dt_bias: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the arguments have the shapes and dtypes of the module contract."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, P], got {tuple(x.shape)}")
    t, h, p = x.shape
    if dt.shape != (t, h):
        raise ValueError(f"dt must be [T, H]={t, h}, got {tuple(dt.shape)}")
    if A.shape != (h,) or (D is not None and D.shape != (h,)) or (dt_bias is not None and dt_bias.shape != (h,)):
        raise ValueError(f"A, D and dt_bias must be [H]=[{h}]")
    if B.dim() != 3 or C.shape != B.shape or B.shape[0] != t or B.shape[1] < 1 or h % B.shape[1]:
        raise ValueError(
            f"B/C must be [T, G, N] alike with H={h} a multiple of G, got {tuple(B.shape)} and {tuple(C.shape)}"
        )
    n = B.shape[2]
    if state.dim() != 4 or state.shape[1:] != (h, p, n) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [slots, {h}, {p}, {n}], got {state.dtype} {tuple(state.shape)}")
    b = slots.shape[0]
    if slots.dim() != 1 or slots.is_floating_point() or has_state.shape != (b,) or has_state.dtype != torch.bool:
        raise ValueError("slots must be int [B] and has_state bool [B]")
    if input_row_offsets.shape != (b + 1,) or input_row_offsets.is_floating_point():
        raise ValueError(f"input_row_offsets must be int [B + 1] = [{b + 1}], got {tuple(input_row_offsets.shape)}")


def _prepare(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    time_step_limit: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 x [T, H, P], discretised dt [T, H], A [H], and B, C [T, H, N] (groups repeated per head)."""
    x32, dt32, a32 = x.to(torch.float32), dt.to(torch.float32), A.to(torch.float32)
    if dt_bias is not None:
        dt32 = dt32 + dt_bias.to(torch.float32)
    if dt_softplus:
        dt32 = torch.nn.functional.softplus(dt32)
    dt32 = dt32.clamp(min=time_step_limit[0], max=time_step_limit[1])  # [T, H]
    ratio = x.shape[1] // B.shape[1]
    b32, c32 = B.to(torch.float32), C.to(torch.float32)
    if ratio != 1:  # each group serves `ratio` consecutive heads
        b32 = b32.repeat_interleave(ratio, dim=1)  # [T, H, N]
        c32 = c32.repeat_interleave(ratio, dim=1)  # [T, H, N]
    return x32, dt32, a32, b32, c32


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    time_step_limit: tuple[float, float] = DEFAULT_TIME_STEP_LIMIT,
) -> torch.Tensor:
    """The SSD recurrence, one request and one token at a time (slow, obviously correct).

    Shapes as the module docstring. Returns the output ``[T, H, P]`` in x's dtype.
    Side effect: ``state[slots[b]]`` holds request b's final state (its stored state when
    ``has_state[b]``, else zeros, advanced over its tokens); other slots are untouched.
    """
    _check(x, dt, A, B, C, D, state, slots, has_state, input_row_offsets, dt_bias)
    x32, dt32, a32, b32, c32 = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, time_step_limit)
    d32 = None if D is None else D.to(torch.float32)
    offsets = input_row_offsets.tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H, P]
    for b, slot in enumerate(slots.tolist()):
        h = state[slot].clone() if bool(has_state[b]) else torch.zeros_like(state[slot])  # [H, P, N]
        for t in range(offsets[b], offsets[b + 1]):
            decay = (dt32[t] * a32).exp()  # [H]
            dbx = (dt32[t][:, None] * x32[t])[:, :, None] * b32[t][:, None, :]  # dt * x ⊗ B [H, P, N]
            h = h * decay[:, None, None] + dbx
            y = torch.einsum("hpn,hn->hp", h, c32[t])  # [H, P]
            out[t] = y if d32 is None else y + d32[:, None] * x32[t]
        state[slot] = h
    return out.to(x.dtype)


def _recurrent_step(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, batched: transformers' ``mamba2_selective_state_update`` without D.
    x [R, H, P]; dt [R, H]; a [H]; b, c [R, H, N]; s [R, H, P, N]. Returns (y [R, H, P], new s)."""
    decay = (dt * a).exp()[..., None, None]  # [R, H, 1, 1]
    s = s * decay + (dt[..., None] * x)[..., None] * b[:, :, None, :]  # [R, H, P, N]
    return (s @ c[..., None]).squeeze(-1), s  # [R, H, P], [R, H, P, N]


def _chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    s: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked SSD of ``mamba2_chunk_scan`` over Q requests at once (without D).

    x [T, H, P]; dt [T, H]; a [H]; b, c [T, H, N] (prepared); s [Q, H, P, N] initial states; request q
    owns rows ``starts[q]:starts[q] + lengths[q]``, with `lengths` non-increasing. Each request is
    zero-padded to whole chunks (as transformers pads: a padded token has dt = 0, so it neither
    decays nor feeds the state) and its chunks are laid out contiguously, K chunks in all. Returns
    (rows [R] long, their outputs [R, H, P], final states [Q, H, P, N]).
    """
    device, cs = x.device, chunk_size
    h, p = x.shape[1], x.shape[2]
    layout = ChunkLayout(lengths, starts, cs, device)
    padded, n_chunks, first_chunk_t = layout.padded, layout.n_chunks, layout.first_chunk
    total_chunks, rows = layout.total_chunks, layout.rows

    xdt = padded(x * dt[..., None])  # [K, H, C, P] discretised x
    a_dt = padded(dt * a)  # [K, H, C] log decay per token
    bc, cc = padded(b), padded(c)  # [K, H, C, N]

    # First phase, every chunk at once (transformers' math)
    a_cum = a_dt.cumsum(dim=-1)  # [K, H, C] log decay from the chunk start
    decay_in = segment_sum(a_dt).exp()  # [K, H, C(l), C(s)] decay from s to l, 0 above the diagonal
    y_diag = ((cc @ bc.transpose(-1, -2)) * decay_in) @ xdt  # [K, H, C, P] intra-chunk outputs
    decay_to_end = (a_cum[..., -1:] - a_cum).exp()  # [K, H, C]
    chunk_states = (xdt * decay_to_end[..., None]).transpose(-1, -2) @ bc  # [K, H, P, N] from zero at the start
    decay_out = a_cum.exp()[..., None]  # [K, H, C, 1] decay from the chunk start to each token
    chunk_decay = a_cum[..., -1].exp()[..., None, None]  # [K, H, 1, 1]

    # Second phase: scan over the chunk index; requests with a j-th chunk are a prefix (lengths sorted)
    s = s.clone()  # [Q, H, P, N]
    out = torch.empty((total_chunks, h, cs, p), dtype=x.dtype, device=device)  # [K, H, C, P]
    for j in range(n_chunks[0] if n_chunks else 0):
        active = sum(1 for n in n_chunks if n > j)
        idx = first_chunk_t[:active] + j  # [A] the j-th chunk of each active request
        s_a = s[:active]  # [A, H, P, N] state at the chunk start
        out[idx] = y_diag[idx] + (cc[idx] @ s_a.transpose(-1, -2)) * decay_out[idx]
        s[:active] = s_a * chunk_decay[idx] + chunk_states[idx]
    out_rows = layout.unpadded(out)  # [R, H, P]
    return rows, out_rows, s


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    time_step_limit: tuple[float, float] = DEFAULT_TIME_STEP_LIMIT,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The SSD scan over a ragged batch, vectorised; same contract as `ssd_reference`.

    One-token requests (decode) take the recurrent step, batched over them; longer requests the
    chunked form with `chunk_size`-token chunks (Mamba2's default 256). Reads ``input_row_offsets``
    on the host once. Returns the output ``[T, H, P]`` in x's dtype; writes each request's final
    state to ``state[slots[b]]`` (zero-token requests get their initial state: stored or zeros);
    other slots are untouched.
    """
    _check(x, dt, A, B, C, D, state, slots, has_state, input_row_offsets, dt_bias)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    x32, dt32, a32, b32, c32 = _prepare(x, dt, A, B, C, dt_bias, dt_softplus, time_step_limit)
    offsets = input_row_offsets.tolist()
    lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    initial = initial_states(state, slots, has_state)  # [B, H, P, N]
    decode = [b for b, n in enumerate(lengths) if n == 1]
    if len(decode) == len(lengths) == x.shape[0]:  # a decode step: row b is request b
        out, final = _recurrent_step(x32, dt32, a32, b32, c32, initial)  # [B, H, P], [B, H, P, N]
    else:
        final = initial.clone()  # [B, H, P, N]
        out = _ragged(x32, dt32, a32, b32, c32, initial, final, offsets, lengths, decode, chunk_size)  # [T, H, P]
    if D is not None:
        out = out + D.to(torch.float32)[:, None] * x32  # the skip, every token
    state[slots.long()] = final
    return out.to(x.dtype)


def _ragged(
    x32: torch.Tensor,
    dt32: torch.Tensor,
    a32: torch.Tensor,
    b32: torch.Tensor,
    c32: torch.Tensor,
    initial: torch.Tensor,
    final: torch.Tensor,
    offsets: list[int],
    lengths: list[int],
    decode: list[int],
    chunk_size: int,
) -> torch.Tensor:
    """`ssd_scan`'s output ``[T, H, P]`` for a batch mixing decodes and prefills; each request's final
    state goes to ``final[b]`` ([B, H, P, N], updated in place)."""
    device = x32.device
    out = torch.zeros(x32.shape, dtype=torch.float32, device=device)  # [T, H, P]
    if decode:
        idx = torch.tensor(decode, device=device)  # [Bd]
        rows = torch.tensor([offsets[b] for b in decode], device=device)  # [Bd]
        out[rows], final[idx] = _recurrent_step(x32[rows], dt32[rows], a32, b32[rows], c32[rows], initial[idx])

    prefill = sorted((b for b, n in enumerate(lengths) if n > 1), key=lambda b: -lengths[b])
    if prefill:
        idx = torch.tensor(prefill, device=device)  # [Q]
        rows, out_rows, final_p = _chunked(
            x32, dt32, a32, b32, c32, initial[idx], [offsets[b] for b in prefill], [lengths[b] for b in prefill],
            chunk_size,
        )  # fmt: skip
        out[rows], final[idx] = out_rows, final_p
    return out
