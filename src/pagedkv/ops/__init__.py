"""Paged KV ops: `store_kv` and `paged_attention` over `RaggedKVCacheInputs`.

Every op has a slow reference (`pagedkv.ops.reference`, loops over tokens) and
a vectorised torch path (`pagedkv.ops.torch_ops`) tested against it; on CUDA a
Triton decode kernel (`pagedkv.ops.triton_decode`) takes decode-only batches.
The backend is chosen here, in one place: ``"auto"`` (default) picks Triton
for decode batches on CUDA when triton is installed, else torch;
`set_backend` overrides it (tests use this to run every path). The Triton
kernel implements plain causal attention only: any masking option of
`paged_attention` (`pagedkv.ops.masks`) sends ``"auto"`` to torch, and a forced
``"triton"`` raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from pagedkv.ops import reference, torch_ops
from pagedkv.ops.checks import check_attention, check_store, reject_nonfinite
from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["AttentionOptions", "PagedMetadata", "paged_attention", "store_kv", "set_backend", "use_backend", "BACKENDS"]

BACKENDS = ("auto", "reference", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose the attention backend for every later call: one of `BACKENDS`."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} must be one of {BACKENDS}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """`set_backend(name)` for the duration of a `with` block."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _triton_usable(query: torch.Tensor, metadata: PagedMetadata) -> bool:
    if query.device.type != "cuda" or metadata.max_q_len != 1:
        return False
    from pagedkv.ops import triton_decode

    return triton_decode.available()


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    inputs: RaggedKVCacheInputs,
    input_row_offsets: torch.Tensor,
    layer: int,
    *,
    metadata: PagedMetadata | None = None,
) -> None:
    """Write one step's K [T, H_kv, D] and V (None for MLA) of `layer` into the pages.

    FP8 caches (`inputs.kv_scales` set) are quantized per (token, head, group).
    Pass the step's `metadata` to skip rebuilding it for every layer. Raises TypeError / ValueError
    (see `pagedkv.ops.checks`) before writing anything; with ``inputs.nonfinite_kv == "reject"``
    (`KVCacheParams.nonfinite_kv`) also ValueError when K or V holds NaN or inf, the cache unchanged.
    """
    check_store(key, value, inputs, input_row_offsets, layer, metadata)
    if inputs.nonfinite_kv != "pass":
        reject_nonfinite(key, value, layer)
    if _backend == "reference":
        reference.store_kv_reference(
            inputs.blocks, key, value, inputs.lookup_table, inputs.cache_lengths, input_row_offsets, layer,
            inputs.kv_scales,
        )  # fmt: skip
        return
    meta = metadata or PagedMetadata.build(inputs, input_row_offsets, key.shape[0])
    torch_ops.store_kv(inputs.blocks, key, value, meta, layer, inputs.kv_scales)


def paged_attention(
    query: torch.Tensor,
    inputs: RaggedKVCacheInputs,
    input_row_offsets: torch.Tensor,
    layer: int,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    metadata: PagedMetadata | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    sink_tokens: int = 0,
    sinks: torch.Tensor | None = None,
    v_head_dim: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of the ragged batch's queries [T, H_q, D] over the paged cache of `layer`: [T, H_q, Dv].

    GQA when H_q is a multiple of H_kv; logits ``q.k * scale`` (default
    1/sqrt(D)), soft-capped as ``softcap * tanh(x / softcap)`` if given. The
    step's new keys must already be stored (`store_kv`). With transformers'
    semantics (details in `pagedkv.ops.masks`; query token i of request b is
    at position ``cache_lengths[b] + i``):

    * ``sliding_window=W``: keys ``q - W < k <= q``; ``chunk_size=C``: keys
      with ``k // C == q // C`` and ``k <= q``; ``sink_tokens=S``: keys
      ``k < S`` are visible as well;
    * ``sinks`` [H_q]: learned sink logits (gpt-oss ``s_aux``), one more
      softmax entry whose probability is dropped;
    * ``v_head_dim=Dv``: values are the first Dv elements of the V slot (MLA:
      of the latent key), output [T, H_q, Dv] (default Dv = D);
    * ``causal=False``: cross-attention, each query sees exactly the request's
      ``cache_lengths[b]`` cached keys (build `metadata` with ``causal=False``).

    Raises ValueError on an invalid option, metadata of the other causality,
    or a forced Triton backend with any option set, and TypeError / ValueError
    for arguments of the wrong type, shape or device (`pagedkv.ops.checks`).
    """
    check_attention(query, inputs, input_row_offsets, layer, scale, softcap, metadata)
    options = AttentionOptions(sliding_window, chunk_size, sink_tokens, sinks, v_head_dim, causal)
    kwargs: dict[str, Any] = dict(
        sliding_window=sliding_window, chunk_size=chunk_size, sink_tokens=sink_tokens, sinks=sinks,
        v_head_dim=v_head_dim, causal=causal,
    )  # fmt: skip
    if _backend == "reference":
        return reference.paged_attention_reference(
            query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, input_row_offsets, layer, scale,
            softcap, inputs.kv_scales, **kwargs,
        )  # fmt: skip
    meta = metadata or PagedMetadata.build(inputs, input_row_offsets, query.shape[0], causal=causal)
    unsupported = options.enabled
    if _backend == "triton":
        if unsupported:
            raise ValueError(f"backend='triton' does not implement {', '.join(unsupported)}; use 'auto' or 'torch'")
        if meta.max_q_len != 1:
            raise ValueError("backend='triton' takes decode batches only (one new token per request)")
    if _backend == "triton" or (_backend == "auto" and not unsupported and _triton_usable(query, meta)):
        from pagedkv.ops import triton_decode

        return triton_decode.paged_decode(query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales)
    return torch_ops.paged_attention(
        query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales, **kwargs
    )  # fmt: skip
