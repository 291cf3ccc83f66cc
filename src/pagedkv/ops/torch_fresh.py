"""Prefill fast path of `torch_ops.paged_attention`: requests with no cached prefix attend over their own new K/V.

A request whose step starts at cache length 0 sees only its own new tokens, query i the keys ``0..i``. Under
plain causal attention (no window, chunk, sink tokens, learned sinks, softcap, ALiBi, MLA value width,
cross-attention) and an unquantized cache of the model's dtype, the keys it reads back from its pages are
exactly the step's K/V the layer just stored. So such a request attends over those directly with
``F.scaled_dot_product_attention(..., is_causal=True)`` in the model's dtype (what transformers' SDPA
attention computes for an unpadded prompt): no page gather, no explicit mask, no float32 copy.
Consecutive requests of one length share one SDPA call (zero-copy views ``[n, H, L, D]`` of the packed
axis); every other request (a cached prefix, a decode token) takes the general path on a subset of the
step's metadata (`PagedMetadata.subset`).

The split of the batch is planned once per step (`plan`, kept in ``meta.plans``), not per layer. CPU only:
the plan reads the request lengths on the host, which on an accelerator would cost a device sync.
Non-finite K/V of the step send the layer to the general path, so they behave exactly as without the fast
path (SDPA lets a later token's NaN value reach earlier queries of the request; the reference does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata

__all__ = ["FreshPlan", "plan", "usable", "fresh_attention"]

# SDPA's enable_gqa keyword came with torch 2.5 (older torch: K/V heads repeated); compared as numbers, not strings
_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
General = Callable[[torch.Tensor, PagedMetadata], torch.Tensor]  # (query [T', H_q, D], metadata) -> [T', H_q, D]


@dataclass(frozen=True)
class FreshPlan:
    """How one step's batch splits between the fast path and the general one.

    Attributes:
        runs: (first token, number of requests, tokens per request) of each run of consecutive requests with
            no cached prefix and one query length; their tokens are ``first .. first + n * length``.
        rest: the metadata of every other request (None when there is none).
        rest_tokens: int64 [T'] those requests' tokens on the step's token axis (None with `rest`).
    """

    runs: tuple[tuple[int, int, int], ...]
    rest: PagedMetadata | None
    rest_tokens: torch.Tensor | None


def usable(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_blocks: torch.Tensor,
    meta: PagedMetadata,
    softcap: float | None,
    kv_scales: torch.Tensor | None,
    options: AttentionOptions,
) -> bool:
    """Whether this layer's call may take the fast path (before the per-step `plan`; the caller sends decode
    steps, whose tokens all have a cached prefix but for one-token prompts, to their own paths).

    query [T, H_q, D], key / value [T, H_kv, D] (the step's, as stored; None: not given).
    """
    if key is None or value is None or options.enabled or softcap is not None or kv_scales is not None:
        return False
    if query.device.type != "cpu" or not meta.causal:
        return False
    dtype = kv_blocks.dtype
    if not (query.dtype == key.dtype == value.dtype == dtype) or dtype not in (torch.float32, torch.bfloat16,
                                                                             torch.float16):  # fmt: skip
        return False
    if key.shape[0] != query.shape[0] or value.shape != key.shape or key.shape[2] != query.shape[2]:
        return False
    total = key.sum(dtype=torch.float32) + value.sum(dtype=torch.float32)  # finite iff every element is
    return bool(torch.isfinite(total))


def plan(meta: PagedMetadata) -> FreshPlan | None:
    """The step's split (`FreshPlan`), or None when no request starts at cache length 0 with tokens to attend.

    Built once per step and kept in ``meta.plans``.
    """
    key = ("fresh",)
    if key not in meta.plans:
        meta.plans[key] = _build_plan(meta)
    result: FreshPlan | None = meta.plans[key]
    return result


def _build_plan(meta: PagedMetadata) -> FreshPlan | None:
    offsets = meta.input_row_offsets.tolist()  # [B + 1] (CPU)
    cached = meta.cache_lengths.tolist()  # [B]
    runs: list[tuple[int, int, int]] = []
    rest: list[int] = []
    for b, length in enumerate(cached):
        first, q_len = offsets[b], offsets[b + 1] - offsets[b]
        if q_len == 0:
            continue
        if length != 0:
            rest.append(b)
        elif runs and runs[-1][2] == q_len and runs[-1][0] + runs[-1][1] * q_len == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, q_len)
        else:
            runs.append((first, 1, q_len))
    if not runs:
        return None
    if not rest:
        return FreshPlan(tuple(runs), None, None)
    sub, tokens = meta.subset(torch.tensor(rest, dtype=torch.int64, device=meta.cache_lengths.device))
    return FreshPlan(tuple(runs), sub, tokens)


def fresh_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    fresh: FreshPlan,
    scale: float,
    general: General,
) -> torch.Tensor:
    """query [T, H_q, D] over the step's key / value [T, H_kv, D] per `fresh`; returns [T, H_q, D].

    The runs attend causally over their own K/V; `general` serves `fresh.rest` (its queries and metadata).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    gqa = num_q_heads != num_kv_heads
    outs: list[tuple[int, int, torch.Tensor]] = []  # (first token, end, [n, L, H_q, D])
    for first, n, length in fresh.runs:
        end = first + n * length
        q = query[first:end].view(n, length, num_q_heads, head_dim).transpose(1, 2)  # [n, H_q, L, D]
        k = key[first:end].view(n, length, num_kv_heads, head_dim).transpose(1, 2)  # [n, H_kv, L, D]
        v = value[first:end].view(n, length, num_kv_heads, head_dim).transpose(1, 2)  # [n, H_kv, L, D]
        if gqa and _ENABLE_GQA:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # [n, H_q, L, D]
        else:
            if gqa:  # torch < 2.5: each K/V head repeated for its query heads
                k, v = (x.repeat_interleave(num_q_heads // num_kv_heads, dim=1) for x in (k, v))  # [n, H_q, L, D]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # [n, H_q, L, D]
        outs.append((first, end, o.transpose(1, 2)))  # [n, L, H_q, D]
    if fresh.rest is None and len(outs) == 1 and outs[0][1] - outs[0][0] == num_tokens:
        return outs[0][2].reshape(num_tokens, num_q_heads, head_dim)  # [T, H_q, D]
    out = query.new_zeros((num_tokens, num_q_heads, head_dim))  # [T, H_q, D]; tokens of no request stay zero
    for first, end, o in outs:
        out[first:end] = o.flatten(0, 1)  # [n * L, H_q, D]
    if fresh.rest is not None and fresh.rest_tokens is not None:
        out[fresh.rest_tokens] = general(query[fresh.rest_tokens], fresh.rest)  # [T', H_q, D]
    return out
