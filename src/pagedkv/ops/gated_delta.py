"""The gated delta rule (Qwen3-Next / Qwen3.5 / OLMo-hybrid linear attention) over a ragged batch.

Each request keeps a fixed-size recurrent state ``S [H, Dk, Dv]`` in a state slot. Per token, per
value head, with the conventions of transformers' ``torch_recurrent_gated_delta_rule``::

    q, k = l2norm(q), l2norm(k)          # only with use_qk_l2norm_in_kernel; rsqrt(sum x^2 + 1e-6)
    q = q * scale                        # always; scale defaults to Dk ** -0.5
    S = exp(g) * S                       # g is the log decay (<= 0)
    S = S + k (beta * (v - S^T k))^T     # the delta rule: write the correction of what S predicts
    o = S^T q

Grouped value heads as transformers: with ``H_v = r * H_k`` each query/key head serves ``r``
consecutive value heads (``repeat_interleave``). All math runs in float32; the output comes back in
the query's dtype, the state stays float32.

Shapes (the ragged layout of the engine: request b owns rows
``input_row_offsets[b]:input_row_offsets[b + 1]``)::

    query, key [T, H_k, Dk]; value [T, H_v, Dv]; g, beta [T, H_v]
    state [num_slots, H_v, Dk, Dv] float32; slots int [B] (distinct); has_state bool [B]
    input_row_offsets int [B + 1]; output [T, H_v, Dv]

`gated_delta_reference` is the slow source of truth (Python loop over requests and tokens);
`gated_delta_rule` is the vectorised path: one-token requests take the recurrent step batched over
requests, longer ones the chunked form of transformers' ``torch_chunk_gated_delta_rule`` with every
chunk of every request solved at once and the scan over chunk index batched over requests.
Both write each request's final state into its slot and leave every other slot untouched.
"""

from __future__ import annotations

import torch

from pagedkv.ops.state_slots import ChunkLayout, initial_states

__all__ = ["gated_delta_reference", "gated_delta_rule", "l2norm"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along `dim`: the FLA / transformers l2norm (eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments have the shapes and dtypes of the module contract."""
    if query.dim() != 3 or key.shape != query.shape:
        raise ValueError(f"query/key must be [T, H_k, Dk] alike, got {tuple(query.shape)} and {tuple(key.shape)}")
    t, h_k, d_k = key.shape
    if value.dim() != 3 or value.shape[0] != t or value.shape[1] % h_k:
        raise ValueError(f"value must be [T, H_v, Dv] with H_v a multiple of H_k={h_k}, got {tuple(value.shape)}")
    h_v, d_v = value.shape[1:]
    if g.shape != (t, h_v) or beta.shape != (t, h_v):
        raise ValueError(f"g/beta must be [T, H_v]={t, h_v}, got {tuple(g.shape)} and {tuple(beta.shape)}")
    if state.dim() != 4 or state.shape[1:] != (h_v, d_k, d_v) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [slots, {h_v}, {d_k}, {d_v}], got {state.dtype} {tuple(state.shape)}")
    b = slots.shape[0]
    if slots.dim() != 1 or slots.is_floating_point() or has_state.shape != (b,) or has_state.dtype != torch.bool:
        raise ValueError("slots must be int [B] and has_state bool [B]")
    if input_row_offsets.shape != (b + 1,) or input_row_offsets.is_floating_point():
        raise ValueError(f"input_row_offsets must be int [B + 1] = [{b + 1}], got {tuple(input_row_offsets.shape)}")


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 q, k [T, H_v, Dk] (value heads repeated, normalised if asked, q scaled), v, g, beta."""
    ratio = value.shape[1] // key.shape[1]
    if ratio != 1:  # grouped value heads: each q/k head serves `ratio` consecutive value heads
        query = query.repeat_interleave(ratio, dim=1)  # [T, H_v, Dk]
        key = key.repeat_interleave(ratio, dim=1)  # [T, H_v, Dk]
    q, k, v, g32, b32 = (x.to(torch.float32) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)  # [T, H_v, Dk]
    return q, k, v, g32, b32


def gated_delta_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """The gated delta rule, one request and one token at a time (slow, obviously correct).

    Shapes as the module docstring. Returns the output ``[T, H_v, Dv]`` in the query's dtype.
    Side effect: ``state[slots[b]]`` holds request b's final state (its stored state when
    ``has_state[b]``, else zeros, advanced over its tokens); other slots are untouched.
    """
    _check(query, key, value, g, beta, state, slots, has_state, input_row_offsets)
    q, k, v, g32, b32 = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale)
    offsets = input_row_offsets.tolist()
    out = torch.zeros(value.shape, dtype=torch.float32, device=value.device)  # [T, H_v, Dv]
    for b, slot in enumerate(slots.tolist()):
        s = state[slot].clone() if bool(has_state[b]) else torch.zeros_like(state[slot])  # [H, Dk, Dv]
        for t in range(offsets[b], offsets[b + 1]):
            s = s * g32[t].exp()[:, None, None]  # decay
            predicted = torch.einsum("hk,hkv->hv", k[t], s)  # what the state recalls for k: S^T k [H, Dv]
            delta = b32[t][:, None] * (v[t] - predicted)  # [H, Dv]
            s = s + torch.einsum("hk,hv->hkv", k[t], delta)  # [H, Dk, Dv]
            out[t] = torch.einsum("hk,hkv->hv", q[t], s)  # S^T q [H, Dv]
        state[slot] = s
    return out.to(query.dtype)


def _recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, batched: transformers' recurrent step. q, k [B, H, Dk]; v [B, H, Dv];
    g, beta [B, H]; s [B, H, Dk, Dv]. Returns (output [B, H, Dv], new state [B, H, Dk, Dv])."""
    s = s * g.exp()[..., None, None]  # [B, H, Dk, Dv]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)  # [B, H, Dv]
    delta = (v - kv_mem) * beta.unsqueeze(-1)  # [B, H, Dv]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)  # [B, H, Dk, Dv]
    return (s * q.unsqueeze(-1)).sum(dim=-2), s  # [B, H, Dv], [B, H, Dk, Dv]


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    s: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule of ``torch_chunk_gated_delta_rule`` over P requests at once.

    q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H] (prepared); s [P, H, Dk, Dv] initial states;
    request p owns rows ``starts[p]:starts[p] + lengths[p]``, with `lengths` non-increasing. Each
    request is zero-padded to whole chunks (as transformers pads) and its chunks are laid out
    contiguously, N chunks in all. Returns (rows [R] long, their outputs [R, H, Dv], final states
    [P, H, Dk, Dv]).
    """
    device, c = q.device, chunk_size
    h, d_v = k.shape[1], v.shape[2]
    layout = ChunkLayout(lengths, starts, c, device)
    padded, n_chunks, first_chunk_t = layout.padded, layout.n_chunks, layout.first_chunk
    total_chunks, rows = layout.total_chunks, layout.rows

    qc, kc, vc = padded(q), padded(k), padded(v)  # [N, H, C, Dk|Dv]
    decay, bc = padded(g), padded(beta)  # [N, H, C]

    # First phase, every chunk at once (transformers' math and order)
    v_beta = vc * bc.unsqueeze(-1)  # [N, H, C, Dv]
    k_beta = kc * bc.unsqueeze(-1)  # [N, H, C, Dk]
    cum_decay = decay.cumsum(dim=-1)  # [N, H, C] log decay from the chunk start
    strictly_upper = torch.ones(c, c, dtype=torch.bool, device=device).triu(1)
    pairwise = cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)  # [N, H, C, C]
    pairwise = pairwise.masked_fill(strictly_upper, float("-inf")).exp()
    ut_system = (k_beta @ kc.transpose(-1, -2)) * pairwise  # [N, H, C, C]
    intra_attn = (qc @ kc.transpose(-1, -2)) * pairwise  # [N, H, C, C]
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)  # [N, H, C, Dk]
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)  # [N, H, C, Dv]
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    q_decayed = qc * cum_decay.exp().unsqueeze(-1)  # [N, H, C, Dk]
    k_decayed = kc * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)  # [N, H, C, Dk]
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    # Second phase: scan over the chunk index; requests with a j-th chunk are a prefix (lengths sorted)
    s = s.clone()  # [P, H, Dk, Dv]
    out = torch.empty((total_chunks, h, c, d_v), dtype=v.dtype, device=device)  # [N, H, C, Dv]
    for j in range(n_chunks[0] if n_chunks else 0):
        active = sum(1 for n in n_chunks if n > j)
        idx = first_chunk_t[:active] + j  # [A] the j-th chunk of each active request
        s_a = s[:active]  # [A, H, Dk, Dv]
        v_new = new_values[idx] - k_cumdecay[idx] @ s_a  # [A, H, C, Dv]
        out[idx] = q_decayed[idx] @ s_a + intra_attn[idx] @ v_new
        s[:active] = s_a * chunk_decay[idx] + k_decayed[idx].transpose(-1, -2) @ v_new
    out_rows = layout.unpadded(out)  # [R, H, Dv]
    return rows, out_rows, s


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    scale: float | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The gated delta rule over a ragged batch, vectorised; same contract as `gated_delta_reference`.

    One-token requests (decode) take the recurrent step, batched over them; longer requests the
    chunked form with `chunk_size`-token chunks. Reads ``input_row_offsets`` on the host once.
    Returns the output ``[T, H_v, Dv]`` in the query's dtype; writes each request's final state to
    ``state[slots[b]]`` (zero-token requests get their initial state: stored or zeros); other slots
    are untouched.
    """
    _check(query, key, value, g, beta, state, slots, has_state, input_row_offsets)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g32, b32 = _prepare(query, key, value, g, beta, use_qk_l2norm_in_kernel, scale)
    offsets = input_row_offsets.tolist()
    lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    device = value.device
    initial = initial_states(state, slots, has_state)  # [B, H, Dk, Dv]
    if len(lengths) == value.shape[0] and all(n == 1 for n in lengths):  # a decode step: row b is request b
        out_d, final_d = _recurrent_step(q, k, v, g32, b32, initial)  # [B, H, Dv], [B, H, Dk, Dv]
        state[slots.long()] = final_d
        return out_d.to(query.dtype)
    final = initial.clone()  # [B, H, Dk, Dv]
    out = torch.zeros(value.shape, dtype=torch.float32, device=device)  # [T, H_v, Dv]

    decode = [b for b, n in enumerate(lengths) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=device)  # [Bd]
        rows = torch.tensor([offsets[b] for b in decode], device=device)  # [Bd]
        out[rows], final[idx] = _recurrent_step(q[rows], k[rows], v[rows], g32[rows], b32[rows], initial[idx])

    prefill = sorted((b for b, n in enumerate(lengths) if n > 1), key=lambda b: -lengths[b])
    if prefill:
        idx = torch.tensor(prefill, device=device)  # [P]
        rows, out_rows, final_p = _chunked(
            q, k, v, g32, b32, initial[idx], [offsets[b] for b in prefill], [lengths[b] for b in prefill], chunk_size
        )
        out[rows], final[idx] = out_rows, final_p

    state[slots.long()] = final
    return out.to(query.dtype)
