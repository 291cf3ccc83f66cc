"""Paged KV ops: `store_kv` and `paged_attention` over `RaggedKVCacheInputs`.

Every op has a slow reference (`pagedkv.ops.reference`, loops over tokens) and
a vectorised torch path (`pagedkv.ops.torch_ops`) tested against it; on CUDA a
Triton decode kernel (`pagedkv.ops.triton_decode`) takes decode-only batches.
The backend is chosen here, in one place: ``"auto"`` (default) picks Triton
for decode batches on CUDA when triton is installed, else torch;
`set_backend` overrides it (tests use this to run every path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedkv.ops import reference, torch_ops
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["PagedMetadata", "paged_attention", "store_kv", "set_backend", "use_backend", "BACKENDS"]

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
    Pass the step's `metadata` to skip rebuilding it for every layer.
    """
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
) -> torch.Tensor:
    """Causal attention of the ragged batch's queries [T, H_q, D] over the paged cache of `layer`.

    GQA when H_q is a multiple of H_kv; logits ``q.k * scale`` (default
    1/sqrt(D)), soft-capped as ``softcap * tanh(x / softcap)`` if given. The
    step's new keys must already be stored (`store_kv`). Returns [T, H_q, D].
    """
    if _backend == "reference":
        return reference.paged_attention_reference(
            query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, input_row_offsets, layer, scale,
            softcap, inputs.kv_scales,
        )  # fmt: skip
    meta = metadata or PagedMetadata.build(inputs, input_row_offsets, query.shape[0])
    if _backend == "triton" and meta.max_q_len != 1:
        raise ValueError("backend='triton' takes decode batches only (one new token per request)")
    if _backend == "triton" or (_backend == "auto" and _triton_usable(query, meta)):
        from pagedkv.ops import triton_decode

        return triton_decode.paged_decode(query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales)
    return torch_ops.paged_attention(query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales)
