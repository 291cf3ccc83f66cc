"""The forward context: what one model forward pass needs to reach the pages, built once per step.

`ForwardContext.build` runs once per engine step, before the model: per
page-table group it derives the attention options from the group's
`KVCacheParams` and builds an `ops.PagedStep` (arguments checked, metadata and
token positions computed), so every attention layer of the pass only looks up
its group and calls ``step.store`` / ``step.attend``. The attention functions
of `pagedkv.hf.attention`, `pagedkv.hf.mla` and `pagedkv.hf.encoder_decoder`
all read this module's types; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv import ops
from pagedkv.hf.mixers.base import StateBatch
from pagedkv.hf.positions import temperature_correction, uses_temperature_tuning
from pagedkv.ops.masks import AttentionOptions
from pagedkv.ops.metadata import PagedMetadata
from pagedkv.params.kv import KVCacheParams
from pagedkv.runtime.inputs import RaggedKVCacheInputs, StateCacheInputs

__all__ = [
    "ATTENTION_NAME", "ForwardContext", "GroupContext", "StateContext", "active", "attention_options", "current",
]  # fmt: skip

ATTENTION_NAME = "pagedkv"
_CURRENT: ContextVar[ForwardContext | None] = ContextVar("pagedkv_forward_context", default=None)


def current() -> ForwardContext | None:
    """The forward context of the pass running now (`active`), or None outside the engine's forward."""
    return _CURRENT.get()


@contextmanager
def active(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current forward context for the duration of one model forward.

    The engine passes the context as the ``pagedkv=ctx`` keyword too; this reaches the attention of
    models whose decoder layers call their attention module without ``**kwargs`` (StableLM) and the
    wrapped attention modules of ALiBi models (`pagedkv.hf.alibi`). One context-variable set per step.
    """
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def attention_options(params: KVCacheParams, alibi_slopes: torch.Tensor | None = None) -> AttentionOptions:
    """The `ops.paged_attention` options that follow from a group's attention kind (window, chunk, sinks, cross)
    and the model's ALiBi slopes [H_q] (None: no ALiBi)."""
    return AttentionOptions(
        sliding_window=params.sliding_window,
        chunk_size=params.attention_chunk_size,
        sink_tokens=params.sink_tokens,
        causal=not params.is_cross_attention,
        alibi_slopes=alibi_slopes,
    )


@dataclass(frozen=True, eq=False)
class GroupContext:
    """One page-table group's step (checked inputs, metadata, options) and the params it came from."""

    params: KVCacheParams
    step: ops.PagedStep

    @property
    def inputs(self) -> RaggedKVCacheInputs:
        """The group's cache inputs of this step."""
        return self.step.inputs

    @property
    def metadata(self) -> PagedMetadata:
        """The group's index tensors of this step."""
        return self.step.metadata

    @property
    def options(self) -> AttentionOptions:
        """The group's attention options (built once per step)."""
        return self.step.options


@dataclass(frozen=True, eq=False)
class StateContext:
    """The recurrent-state groups of one step, built once: per state group a `StateBatch` (its slots), and
    per model layer its group's batch and its state tensors (`pagedkv.hf.mixers` adapters read them).

    Attributes:
        batches: state group index (in ``params.leaves()``) -> the step's `StateBatch` of that group.
        records: state group index -> its `StateCacheInputs`.
        state_map: model layer index -> (state group index, layer slot in the group).
    """

    batches: dict[int, StateBatch]
    records: dict[int, StateCacheInputs]
    state_map: dict[int, tuple[int, int]]

    @property
    def device(self) -> torch.device:
        """The device of the state tensors."""
        return next(iter(self.records.values())).state_slots.device

    @property
    def positions(self) -> torch.Tensor:
        """int64 [T] on the device: each packed token's position (its request's processed tokens plus its
        offset in the step); what a model without an attention group gets as ``position_ids``."""
        batch = next(iter(self.batches.values()))
        record = next(iter(self.records.values()))
        offsets, total = batch.input_row_offsets, sum(batch.lengths)  # [B + 1]
        counts = offsets[1:] - offsets[:-1]  # [B]
        starts = torch.repeat_interleave(offsets[:-1], counts, output_size=total)  # [T]
        base = torch.repeat_interleave(record.cache_lengths.to(torch.int64), counts, output_size=total)  # [T]
        return base + torch.arange(total, device=offsets.device) - starts  # [T]

    @classmethod
    def build(
        cls,
        records: dict[int, StateCacheInputs],
        input_row_offsets: torch.Tensor,
        state_map: dict[int, tuple[int, int]],
    ) -> StateContext:
        """The context of `records` (one per state group, one device) for requests packed at `input_row_offsets`
        (int [B + 1], host or device). ValueError when `state_map` names a group without a record."""
        missing = sorted({g for g, _ in state_map.values()} - set(records))
        if missing:
            raise ValueError(f"state_map names state groups {missing} that have no StateCacheInputs")
        first = next(iter(records.values()))
        device = first.state_slots.device
        host = input_row_offsets.to("cpu", torch.int64)  # [B + 1]
        lengths = (host[1:] - host[:-1]).tolist()
        offsets = host.to(device)  # [B + 1]
        has_state = first.has_initial_state  # [B] (every state group shares the requests' progress)
        batches = {
            g: StateBatch(offsets, lengths, rec.state_slots[:, 0].to(torch.int64), has_state, host)
            for g, rec in records.items()
        }
        return cls(batches, dict(records), dict(state_map))

    def locate(self, layer_idx: int) -> tuple[StateBatch, tuple[torch.Tensor, ...]]:
        """The step's batch and the state tensors ``[num_pages, *shape]`` of model layer `layer_idx`;
        KeyError naming the layer when it has no state group."""
        if layer_idx not in self.state_map:
            raise KeyError(f"model layer {layer_idx} has no state group (state layers: {sorted(self.state_map)})")
        group, slot = self.state_map[layer_idx]
        return self.batches[group], self.records[group].layer_states[slot]


@dataclass(frozen=True, eq=False)
class ForwardContext:
    """What one forward pass needs to reach the pages: passed as ``model(..., pagedkv=ctx)``.

    Attributes:
        groups: one `GroupContext` per page-table group.
        input_row_offsets: int [B + 1], where each request's tokens start on the packed axis.
        layer_map: model layer index -> (group, layer slot in the group); empty means group 0, slot = index.
        sequence_lengths: int64 [B] on the host, each request's whole length at this step (prompt plus
            generated tokens: what transformers' one-pass prefill or decode step sees); None means each
            request's last position of the step + 1. Length-dependent RoPE follows it (`pagedkv.hf.positions`).
        query_scale: float32 [T, 1, 1], the factor Llama 4's temperature-tuned (NoPE) layers' queries need
            to carry each token's own position's scale (`positions.temperature_correction`); None when the
            model config given to `build` has no temperature tuning (or no config was given).
    """

    groups: list[GroupContext]
    input_row_offsets: torch.Tensor
    layer_map: dict[int, tuple[int, int]] = field(default_factory=dict)
    sequence_lengths: torch.Tensor | None = None
    query_scale: torch.Tensor | None = None
    states: StateContext | None = None

    @classmethod
    def build(
        cls,
        inputs: list[RaggedKVCacheInputs],
        params: list[KVCacheParams],
        input_row_offsets: torch.Tensor,
        num_tokens: int,
        layer_map: dict[int, tuple[int, int]] | None = None,
        *,
        sequence_lengths: torch.Tensor | None = None,
        model_config: Any = None,
        alibi_slopes: torch.Tensor | None = None,
        states: StateContext | None = None,
    ) -> ForwardContext:
        """A context for one device: `inputs[g]` and `params[g]` per group, `num_tokens` packed tokens.

        Per group, once: the attention options, the argument checks and the metadata
        (`ops.PagedStep.build`). Groups whose inputs share one ``cache_lengths`` tensor (the
        decoder groups of a hybrid model) share one computation of the token positions.
        `sequence_lengths` (int [B], host): each request's whole length at this step (see the
        attribute). `model_config` (the transformers config): its position-dependent features
        are computed here, once per step, from each token's own position (`pagedkv.hf.positions`);
        without it a temperature-tuned Llama 4 layer refuses to run. `alibi_slopes` (float32 [H_q], the
        model's, `pagedkv.hf.alibi.slopes`) join every group's options. `states`: the step's recurrent-state
        groups (`StateContext`), for models with state layers (a pure state model has no attention
        `inputs`). Raises ValueError when `sequence_lengths` does not have one entry per request.
        """
        if not inputs and states is None:
            raise ValueError("a forward context needs attention inputs or a StateContext")
        device = inputs[0].cache_lengths.device if inputs else states.device  # type: ignore[union-attr]
        offsets = input_row_offsets.to(device)  # [B + 1]
        groups: list[GroupContext] = []
        positions: dict[int, PagedMetadata] = {}  # id(cache_lengths) -> the first metadata built over it
        for group_inputs, group_params in zip(inputs, params, strict=True):
            key = id(group_inputs.cache_lengths)
            step = ops.PagedStep.build(
                group_inputs,
                offsets,
                num_tokens,
                attention_options(group_params, alibi_slopes),
                positions_of=positions.get(key),
            )
            positions.setdefault(key, step.metadata)
            groups.append(GroupContext(group_params, step))
        lengths = None
        if sequence_lengths is not None:
            lengths = torch.as_tensor(sequence_lengths, dtype=torch.int64, device="cpu")  # [B]
            if lengths.shape != (offsets.shape[0] - 1,):
                raise ValueError(f"sequence_lengths has shape {tuple(lengths.shape)}; {offsets.shape[0] - 1} requests")
        ctx = cls(groups, offsets, dict(layer_map or {}), lengths, None, states)
        if model_config is None or not uses_temperature_tuning(model_config):
            return ctx
        scale = temperature_correction(model_config, ctx.positions)  # [T, 1, 1]
        return cls(groups, offsets, ctx.layer_map, lengths, scale, states)

    @property
    def token_sequence_lengths(self) -> torch.Tensor:
        """int64 [T] on the host: the sequence length (see `sequence_lengths`) of each packed token's request."""
        offsets = self.input_row_offsets.cpu()  # [B + 1]
        lengths = self.sequence_lengths
        if lengths is None:  # each request's last position of the step + 1
            causal = next((g for g in self.groups if g.options.causal), None)
            if causal is None:
                raise ValueError("this forward context has no causal page-table group, so no sequence lengths")
            lengths = causal.metadata.kv_lengths.cpu()  # [B]
        return torch.repeat_interleave(lengths, offsets[1:] - offsets[:-1])  # [T]

    @property
    def positions(self) -> torch.Tensor:
        """int64 [T] on the cache's device: each packed token's position (the first causal group's metadata)."""
        for group in self.groups:
            if group.options.causal:
                return group.metadata.token_position  # [T]
        if self.states is not None:  # a pure state model
            return self.states.positions  # [T]
        raise ValueError("this forward context has no causal page-table group, so no token positions")

    def locate(self, layer_idx: int) -> tuple[GroupContext, int]:
        """The group and layer slot of model layer `layer_idx`."""
        group, slot = self.layer_map.get(layer_idx, (0, layer_idx))
        return self.groups[group], slot
