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

Arguments are checked once, at the entry point (`pagedkv.ops.checks`); the
backends do not check them again. A model step calls the ops once per layer
with the same cache inputs, offsets and options: `PagedStep` checks those and
builds the metadata once per step, and its `store` / `attend` go straight to
the backend for every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedkv.ops import reference, torch_ops
from pagedkv.ops.checks import check_attention, check_kv_kinds, check_step, check_store, reject_nonfinite
from pagedkv.ops.conv_state import causal_conv1d
from pagedkv.ops.gated_delta import gated_delta_rule
from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.ops.selective_scan import selective_scan
from pagedkv.ops.ssd import ssd_scan
from pagedkv.runtime.inputs import RaggedKVCacheInputs

__all__ = [
    "AttentionOptions", "PagedMetadata", "PagedStep", "paged_attention", "store_kv", "set_backend", "use_backend",
    "BACKENDS", "causal_conv1d", "gated_delta_rule", "selective_scan", "ssd_scan",
]  # fmt: skip

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
    if metadata is not None and not metadata.causal:
        raise ValueError("store_kv needs causal metadata: causal=False (cross-attention) steps store no keys")
    _store(key, value, inputs, input_row_offsets, layer, metadata)


def _store(
    key: torch.Tensor,
    value: torch.Tensor | None,
    inputs: RaggedKVCacheInputs,
    input_row_offsets: torch.Tensor,
    layer: int,
    metadata: PagedMetadata | None,
) -> None:
    """`store_kv` on checked arguments: the non-finite policy, then the backend."""
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
    alibi_slopes: torch.Tensor | None = None,
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
      ``cache_lengths[b]`` cached keys (build `metadata` with ``causal=False``);
    * ``alibi_slopes`` [H_q] (ALiBi: Bloom, MPT, Falcon): query head h adds
      ``alibi_slopes[h] * (k - q)`` to the logit of key position k after the
      scale and softcap (Falcon: pass its slopes times the scale; see
      `pagedkv.ops.masks`).

    Raises ValueError on an invalid option, metadata of the other causality,
    or a forced Triton backend with any option set, and TypeError / ValueError
    for arguments of the wrong type, shape or device (`pagedkv.ops.checks`).
    """
    check_attention(query, inputs, input_row_offsets, layer, scale, softcap, metadata)
    options = AttentionOptions(sliding_window, chunk_size, sink_tokens, sinks, v_head_dim, causal, alibi_slopes)
    options.check(query.shape[1], inputs.blocks.shape[5])
    if metadata is not None and metadata.causal != causal:
        raise ValueError(f"causal={causal} but the metadata was built with causal={metadata.causal}")
    return _attend(query, inputs, input_row_offsets, layer, scale, softcap, metadata, options)


def _attend(
    query: torch.Tensor,
    inputs: RaggedKVCacheInputs,
    input_row_offsets: torch.Tensor,
    layer: int,
    scale: float | None,
    softcap: float | None,
    metadata: PagedMetadata | None,
    options: AttentionOptions,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` on checked arguments: picks the backend; returns [T, H_q, Dv].

    `key` / `value` [T, H_kv, D]: the step's K/V as stored, which the torch backend may attend directly for
    requests with no cached prefix (`torch_ops.paged_attention`); the other backends read the pages.
    """
    if _backend == "reference":
        return reference.paged_attention_reference(
            query, inputs.blocks, inputs.lookup_table, inputs.cache_lengths, input_row_offsets, layer, scale,
            softcap, inputs.kv_scales, sliding_window=options.sliding_window, chunk_size=options.chunk_size,
            sink_tokens=options.sink_tokens, sinks=options.sinks, v_head_dim=options.v_head_dim, causal=options.causal,
            alibi_slopes=options.alibi_slopes,
        )  # fmt: skip  # [T, H_q, Dv]
    meta = metadata or PagedMetadata.build(inputs, input_row_offsets, query.shape[0], causal=options.causal)
    unsupported = options.enabled
    if _backend == "triton":
        if unsupported:
            raise ValueError(f"backend='triton' does not implement {', '.join(unsupported)}; use 'auto' or 'torch'")
        if meta.max_q_len != 1:
            raise ValueError("backend='triton' takes decode batches only (one new token per request)")
    if _backend == "triton" or (_backend == "auto" and not unsupported and _triton_usable(query, meta)):
        from pagedkv.ops import triton_decode

        return triton_decode.paged_decode(
            query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales, checked=True
        )  # [T, H_q, D]
    return torch_ops.paged_attention(
        query, inputs.blocks, meta, layer, scale, softcap, inputs.kv_scales, options, key, value
    )  # [T, H_q, Dv]


@dataclass(frozen=True, eq=False)
class PagedStep:
    """One page-table group's share of a model step: checked once, used by every layer.

    `build` checks the cache inputs, the row offsets and the options (`pagedkv.ops.checks`) and
    builds the `PagedMetadata`, once per step; `store` and `attend` then run one layer's
    `store_kv` / `paged_attention` on those without checking them again: only the layer index
    is bounds-checked, the layer's tensors are the model's. The results are those of
    `store_kv` / `paged_attention` with the same arguments.

    Attributes:
        inputs: the group's cache inputs of this step.
        input_row_offsets: int64 [B + 1] on the cache's device.
        metadata: the step's index tensors.
        options: the group's attention options (window, chunk, sink tokens, causality).
    """

    inputs: RaggedKVCacheInputs
    input_row_offsets: torch.Tensor
    metadata: PagedMetadata
    options: AttentionOptions
    # non-empty until the step's first `store` checked its K/V against the pages (once per step, not per layer)
    _unchecked: list[bool] = dataclasses.field(default_factory=lambda: [True], init=False, repr=False)

    @classmethod
    def build(
        cls,
        inputs: RaggedKVCacheInputs,
        input_row_offsets: torch.Tensor,
        num_tokens: int | None = None,
        options: AttentionOptions | None = None,
        *,
        positions_of: PagedMetadata | None = None,
    ) -> PagedStep:
        """Check the step's arguments and build its metadata (see `PagedMetadata.build` for the keywords).

        `options` (default: plain causal attention) must not carry per-layer `sinks`; pass those to `attend`.
        ALiBi `options.alibi_slopes` [H_q] (the same for every layer) belong here; `attend` then takes
        queries of H_q heads only.
        Raises TypeError / ValueError like `store_kv` and `paged_attention` do for these arguments.
        """
        options = options or AttentionOptions()
        blocks = check_step(inputs, input_row_offsets)
        if options.sinks is not None:
            raise ValueError("PagedStep options take no sinks: learned sinks are per layer, pass them to attend()")
        num_q_heads = blocks.shape[4]  # H_q is the layers' (sinks come per layer); ALiBi slopes name it
        slopes = options.alibi_slopes
        if isinstance(slopes, torch.Tensor) and slopes.dim() == 1:
            num_q_heads = slopes.shape[0]
            if num_q_heads % blocks.shape[4]:
                raise ValueError(f"alibi_slopes has {num_q_heads} heads, not a multiple of H_kv={blocks.shape[4]}")
        options.check(num_q_heads, blocks.shape[5])
        metadata = PagedMetadata.build(
            inputs, input_row_offsets, num_tokens, causal=options.causal, positions_of=positions_of
        )
        return cls(inputs, metadata.input_row_offsets, metadata, options)

    def store(self, key: torch.Tensor, value: torch.Tensor | None, layer: int) -> None:
        """`store_kv(key [T, H_kv, D], value, ...)` of `layer` into this step's slots.

        The step's first call checks K and V against the pages (`check_kv`): every layer of a group stores
        the same [H_kv, D], so one check per step catches a model whose K/V disagree with the cache layout.
        """
        if not self.options.causal:
            raise ValueError("store_kv needs causal metadata: causal=False (cross-attention) steps store no keys")
        if not 0 <= layer < self.inputs.blocks.shape[2]:  # the one per-layer argument
            raise ValueError(f"layer={layer} must be in [0, {self.inputs.blocks.shape[2]}) (the cache's layers)")
        if self._unchecked:
            self.check_kv(key, value)
            self._unchecked.clear()
        _store(key, value, self.inputs, self.input_row_offsets, layer, self.metadata)

    def check_kv(self, key: torch.Tensor, value: torch.Tensor | None) -> None:
        """ValueError unless `key` (and `value`) are [T, H_kv, D] of the step's T tokens and the pages' (H_kv, D),
        with a value exactly when the pages hold one (not for MLA). Reads shapes only."""
        blocks = self.inputs.blocks
        expected = (self.metadata.num_tokens, *blocks.shape[4:])
        for name, x in (("key", key), ("value", value)):
            if x is not None and tuple(x.shape) != expected:
                raise ValueError(
                    f"{name} shape {tuple(x.shape)} != the step's [T, H_kv, D]={list(expected)}: the model's "
                    f"attention gives K/V of another layout than the pages hold (H_kv={blocks.shape[4]}, "
                    f"D={blocks.shape[5]})"
                )
        check_kv_kinds(value, blocks)

    def attend(
        self,
        query: torch.Tensor,
        layer: int,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        v_head_dim: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`paged_attention(query [T, H_q, D], ...)` of `layer` with the step's options: [T, H_q, Dv].

        `sinks` [H_q] (a layer's learned sinks) and `v_head_dim` (MLA) join the step's options for
        this call only; like the query, they come from the model's layer and are not checked here.
        `key` / `value` [T, H_kv, D]: this layer's K/V exactly as just passed to `store` (optional): requests
        with no cached prefix may then attend over them instead of reading their pages back (same result,
        no gather; `pagedkv.ops.torch_fresh`). Passing anything else gives wrong results.
        """
        if not 0 <= layer < self.inputs.blocks.shape[2]:  # the one per-layer argument
            raise ValueError(f"layer={layer} must be in [0, {self.inputs.blocks.shape[2]}) (the cache's layers)")
        options = self.options
        if options.alibi_slopes is not None and query.shape[1] != options.alibi_slopes.shape[0]:
            raise ValueError(
                f"query has {query.shape[1]} heads but the step's alibi_slopes {options.alibi_slopes.shape[0]}"
            )
        if sinks is not None or v_head_dim is not None:
            options = dataclasses.replace(options, sinks=sinks, v_head_dim=v_head_dim)
        return _attend(
            query, self.inputs, self.input_row_offsets, layer, scale, softcap, self.metadata, options, key, value
        )  # [T, H_q, Dv]
