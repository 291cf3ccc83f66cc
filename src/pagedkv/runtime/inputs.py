"""Runtime KV cache inputs: the tensors a model's attention reads each step.

Per device, a `RaggedKVCacheInputs`::

    blocks        [total_num_pages + 1, kv_dim, num_layers, page_size, heads, head_dim]
    cache_lengths int32 [batch]             tokens already in the cache per request
    lookup_table  int32 [batch, cols]       page ids, null-padded (cols = round_up(pages, 8) + 16)
    max_lengths   int32 [num_steps, 2] CPU  row s: (max prompt length, max cache length)
    kv_scales     FP8 scales, same page layout (quantized caches only)

The token at position p of request b lives in page ``lookup_table[b, p // page_size]``
at slot ``p % page_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.params.records import InputTree, RecordMixin, TreeMapMixin

__all__ = [
    "KVCacheInputs",
    "RaggedKVCacheInputs",
    "PaddedKVCacheInputs",
    "KVCacheInputsSequence",
    "MultiKVCacheInputs",
    "StateCacheInputs",
    "max_lengths_table",
]


class KVCacheInputs(InputTree[torch.Tensor]):
    """Base of the KV input records, and the per-device container: `.inputs` lists them."""


@dataclass(eq=False)
class RaggedKVCacheInputs(RecordMixin, KVCacheInputs):
    """One device's inputs for a ragged (packed, variable-length) batch; see module docstring."""

    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_lengths: torch.Tensor
    kv_scales: torch.Tensor | None = None
    # `KVCacheParams.nonfinite_kv` of the cache ("pass" or "reject"): what `ops.store_kv` does with NaN/inf.
    # Not a field (no input tensor): set on the record by the manager that built it.
    nonfinite_kv = "pass"

    def with_policy(self, nonfinite_kv: str) -> RaggedKVCacheInputs:
        """This record, storing under `nonfinite_kv` (see above); returns self."""
        self.nonfinite_kv = nonfinite_kv
        return self


@dataclass(eq=False)
class StateCacheInputs(RecordMixin, KVCacheInputs):
    """One device's inputs of a state group (recurrent layers) for a ragged batch.

    blocks             uint8 [total_num_pages + 1, num_layers, layer_bytes]  the group's pages
    cache_lengths      int32 [batch]        tokens already processed per request (its state covers them)
    state_slots        int32 [batch, 1 + num_speculative_blocks]  column 0: the live state slot (a page
                       id of the group), then the draft slots
    has_initial_state  bool [batch]         True: continue from the slot; False: start from zeros (the
                       slot's bytes are stale and must not be read)

    `layer_states[layer]` (not a field: views, no input tensor of their own) are the layer's state
    tensors ``[total_num_pages + 1, *shape]`` over `blocks` (`pagedkv.runtime.state_buffers`).
    """

    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    state_slots: torch.Tensor
    has_initial_state: torch.Tensor
    layer_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list, repr=False)

    def flatten(self) -> list[torch.Tensor]:
        return [self.blocks, self.cache_lengths, self.state_slots, self.has_initial_state]


@dataclass(eq=False)
class PaddedKVCacheInputs(RecordMixin, KVCacheInputs):
    """One device's inputs for a padded batch: every request starts at `start_pos`.

    k_cache, v_cache: [batch, num_layers, max_seq_len, heads, head_dim] views of the slots.
    start_pos: int64 scalar, the common cache length. null_op: an empty tensor.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start_pos: torch.Tensor
    null_op: torch.Tensor


class KVCacheInputsSequence(KVCacheInputs):
    """A sequence of `KVCacheInputs` (one per step of a multistep run, or per replica)."""

    def __init__(self, kv_cache_inputs: Sequence[KVCacheInputs]) -> None:
        self.kv_cache_inputs = list(kv_cache_inputs)
        super().__init__(self.kv_cache_inputs)


class MultiKVCacheInputs(TreeMapMixin, KVCacheInputs):
    """Inputs of a multi-cache model: one child per cache, sharing lookup tables and cache lengths."""

    def __init__(self, children: Mapping[str, KVCacheInputs]) -> None:
        super().__init__(self._init_children(children))


def max_lengths_table(max_prompt_length: int, max_cache_length: int, num_steps: int = 1) -> torch.Tensor:
    """int32 [num_steps, 2] on CPU: row s = (max_prompt_length if s == 0 else 1, max_cache_length + s)."""
    rows = [(max_prompt_length if s == 0 else 1, max_cache_length + s) for s in range(num_steps)]
    return torch.tensor(rows, dtype=torch.int32).reshape(num_steps, 2)
