"""Argument checks of `ops.store_kv`, `ops.paged_attention` and `ops.PagedStep`, done once at the entry point.

The backends (torch, Triton) trust what passed here and do not check it again.
`check_step` covers what a whole step shares (the cache inputs and row offsets):
`ops.PagedStep.build` runs it once per step instead of once per layer. They run
before anything is read or written, on tensor attributes only (shape, dtype, device: no
device sync), and raise TypeError (wrong type or dtype) or ValueError (wrong shape, device, layer),
naming the argument, its value and what was expected. `check_store` also reads the row offsets, cache
lengths and lookup table on the host, so that no row of a public `ops.store_kv` call lands outside its
request's pages (a device sync on a GPU; `PagedStep`, which the engine uses, builds its own offsets). `reject_nonfinite` is the
``nonfinite_kv="reject"`` policy: it is called only under that policy, so "pass" costs nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedkv.ops.metadata import PagedMetadata
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = ["check_attention", "check_kv_kinds", "check_step", "check_store", "reject_nonfinite"]


_INT_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def check_step(inputs: Any, offsets: Any) -> torch.Tensor:
    """What every layer of a step shares: the cache inputs and the row offsets; returns the page tensor."""
    if not isinstance(inputs, RaggedKVCacheInputs):
        raise TypeError(f"inputs must be RaggedKVCacheInputs, got {type(inputs).__name__}")
    blocks = inputs.blocks
    if not isinstance(blocks, torch.Tensor) or len(blocks.shape) != 6:
        shape = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"inputs.blocks must be [pages, kv_dim, layers, page_size, H_kv, D], got {shape}")
    scales = inputs.kv_scales
    if scales is not None and (scales.shape[:-1] != blocks.shape[:-1] or scales.device != blocks.device):
        raise ValueError(f"inputs.kv_scales {tuple(scales.shape)} on {scales.device} does not match the pages "
                         f"{tuple(blocks.shape)} on {blocks.device}")  # fmt: skip
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"input_row_offsets must be an integer torch.Tensor [B + 1], got {type(offsets).__name__}")
    if offsets.dtype not in _INT_DTYPES:
        raise TypeError(f"input_row_offsets has dtype {offsets.dtype}; it must be an integer tensor")
    batch = inputs.cache_lengths.shape[0]
    if offsets.dim() != 1 or offsets.shape[0] != batch + 1:
        raise ValueError(f"input_row_offsets has shape {tuple(offsets.shape)}; a batch of {batch} needs [{batch + 1}]")
    return blocks


def _check_inputs(inputs: Any, offsets: Any, layer: Any) -> torch.Tensor:
    """The cache inputs, the row offsets and the layer; returns the page tensor."""
    blocks = check_step(inputs, offsets)
    if type(layer) is not int and (not isinstance(layer, int) or isinstance(layer, bool)):
        raise TypeError(f"layer={layer!r} must be an int")
    if not 0 <= layer < blocks.shape[2]:
        raise ValueError(f"layer={layer} must be in [0, {blocks.shape[2]}) (the cache's layers)")
    return blocks


def _num_tokens(offsets: torch.Tensor, meta: PagedMetadata | None) -> int | None:
    """T of the batch: the metadata's, else the offsets' last entry on CPU (None: unknown without a sync)."""
    if meta is not None:
        return meta.num_tokens
    if offsets.device.type == "cpu" and offsets.numel():
        return int(offsets[-1])
    return None


def _check_tokens(name: str, x: Any, blocks: torch.Tensor, tokens: int | None) -> None:
    """`x` is a floating tensor [T, H, D] on the cache's device, T matching the batch."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [T, H, D], got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} has dtype {x.dtype}; it must be floating point")
    if x.device != blocks.device:
        raise ValueError(f"{name} is on {x.device} but the cache is on {blocks.device}")
    shape = x.shape
    if len(shape) != 3:
        raise ValueError(f"{name} shape {tuple(shape)} must be [T, H, D]")
    if tokens is not None and shape[0] != tokens:
        raise ValueError(f"{name} has {shape[0]} tokens but the batch's input_row_offsets end at {tokens}")


def check_store(
    key: Any, value: Any, inputs: Any, offsets: Any, layer: Any, meta: PagedMetadata | None
) -> None:  # fmt: skip
    """`store_kv`'s arguments: K (and V) [T, H_kv, D] of the cache's heads, width and device."""
    blocks = _check_inputs(inputs, offsets, layer)
    tokens, page = _num_tokens(offsets, meta), blocks.shape[4:]
    for name, x in (("key", key), ("value", value)):
        if x is None and name == "value":
            continue
        _check_tokens(name, x, blocks, tokens)
        if x.shape[1:] != page:
            raise ValueError(f"{name} shape {tuple(x.shape)} != [T, H_kv, D] with (H_kv, D)={tuple(page)}")
    check_kv_kinds(value, blocks)
    _check_rows(offsets, inputs, blocks, key.shape[0])


def check_kv_kinds(value: Any, blocks: torch.Tensor) -> None:
    """V is given exactly when the cache stores it: kv_dim=2 pages need a value, kv_dim=1 (MLA) pages take none."""
    if value is not None and blocks.shape[1] == 1:
        raise ValueError("value given for a cache with kv_dim=1 (MLA stores K only)")
    if value is None and blocks.shape[1] != 1:
        raise ValueError(f"value is None but the cache stores K and V (kv_dim={blocks.shape[1]}): pass value "
                         "[T, H_kv, D] (only an MLA cache, kv_dim=1, stores K alone)")  # fmt: skip


def _check_rows(offsets: torch.Tensor, inputs: RaggedKVCacheInputs, blocks: torch.Tensor, tokens: int) -> None:
    """Every request's rows of the step land in pages of its own: the offsets start at 0, never decrease and
    end at the `tokens` K rows, no request has more new tokens than the batch's longest (``max_lengths[0, 0]``),
    and each token's position falls on a page of its lookup-table row, never past it or on the null page
    (except a dummy request's, whose whole row is the null page).
    Reads the offsets, cache lengths and table on the host (a device sync when they live on a GPU)."""
    host = offsets.to("cpu", torch.int64)  # [B + 1]
    counts = host[1:] - host[:-1]  # [B]
    shown = host.tolist()
    if shown[0] != 0 or bool((counts < 0).any()):
        raise ValueError(f"input_row_offsets={shown} must start at 0 and never decrease")
    if shown[-1] != tokens:
        raise ValueError(f"input_row_offsets={shown} end at {shown[-1]} but key has {tokens} tokens")
    if not counts.numel():
        return
    longest = int(inputs.max_lengths[0, 0])  # host table
    request = int(counts.argmax())
    if int(counts[request]) > longest:
        raise ValueError(f"input_row_offsets={shown} give request {request} {int(counts[request])} tokens, more "
                         f"than the batch's longest, {longest} (inputs.max_lengths[0, 0])")  # fmt: skip
    cached = inputs.cache_lengths.to("cpu", torch.int64)  # [B]
    table = inputs.lookup_table.to("cpu", torch.int64)  # [B, C]
    owner = torch.repeat_interleave(torch.arange(counts.shape[0]), counts, output_size=tokens)  # [T]
    position = cached[owner] + torch.arange(tokens) - host[:-1][owner]  # [T]
    column = position // blocks.shape[3]  # [T]
    outside = column >= table.shape[1]  # [T]
    page = table[owner, column.clamp(max=max(table.shape[1] - 1, 0))] if table.shape[1] else column  # [T]
    null = blocks.shape[0] - 1  # the null page is the last one
    dummy = (table == null).all(dim=1) if table.shape[1] else torch.ones(counts.shape[0], dtype=torch.bool)  # [B]
    bad = ~dummy[owner] & (outside | (page < 0) | (page >= null))  # [T] (a dummy request writes to the null page)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        b, pos, col = int(owner[t]), int(position[t]), int(column[t])
        held = "the null page" if int(page[t]) == null else f"page {int(page[t])}, not one of the cache's {null}"
        where = (f"past its lookup_table row of {table.shape[1]} pages" if bool(outside[t]) else
                 f"on column {col} of its lookup_table row, which holds {held}")  # fmt: skip
        raise ValueError(f"input_row_offsets={shown} give request {b} {int(counts[b])} tokens after its "
                         f"{int(cached[b])} cached ones: its token at position {pos} would land {where}")  # fmt: skip


def check_attention(
    query: Any, inputs: Any, offsets: Any, layer: Any, scale: Any, softcap: Any, meta: PagedMetadata | None
) -> None:
    """`paged_attention`'s arguments: query [T, H_q, D] (H_q a multiple of H_kv), a finite scale and softcap."""
    blocks = _check_inputs(inputs, offsets, layer)
    _check_tokens("query", query, blocks, _num_tokens(offsets, meta))
    if query.shape[2] != blocks.shape[5] or query.shape[1] % blocks.shape[4]:
        raise ValueError(f"query shape {tuple(query.shape)} != [T, H_q, D={blocks.shape[5]}] with H_q a multiple "
                         f"of H_kv={blocks.shape[4]}")  # fmt: skip
    for name, number in (("scale", scale), ("softcap", softcap)):
        if number is None:
            continue
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise TypeError(f"{name}={number!r} must be a number or None")
        if not 0 < number < math.inf:
            raise ValueError(f"{name}={number!r} must be a finite number > 0")


def reject_nonfinite(key: torch.Tensor, value: torch.Tensor | None, layer: int) -> None:
    """ValueError when K or V of `layer` holds NaN or inf (``nonfinite_kv="reject"``; nothing is written)."""
    for name, x in (("key", key), ("value", value)):
        if x is None:
            continue
        bad = int(x.numel() - torch.isfinite(x).sum())
        if bad:
            raise ValueError(
                f"store_kv: {name} of layer {layer} has {bad} non-finite values (NaN/inf) of {x.numel()}; "
                "nonfinite_kv='reject' stores nothing"
            )
