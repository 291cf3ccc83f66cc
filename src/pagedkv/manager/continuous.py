"""`ContinuousBatchingKVCacheManager`: one contiguous `max_seq_len` slot per sequence.

The layout is a paged cache whose pages are whole sequences: per device
``[max_batch_size + 1, kv_dim, num_layers, max_seq_len, heads, head_dim]``,
the last slot being the null slot. Every sequence pays for `max_seq_len`
tokens whatever its length, which is the waste paging removes; it is the
baseline `pagedkv bench manager` compares against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.tables import lut_columns
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.base import KVCacheManager, T, check_redundant_args
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.symbols import KVCacheInputSymbols, PaddedKVCacheInputSymbols, TensorSpec
from pagedkv.params.validation import check_int
from pagedkv.runtime.inputs import KVCacheInputs, PaddedKVCacheInputs, RaggedKVCacheInputs, max_lengths_table

__all__ = ["ContinuousBatchingKVCacheManager"]


class ContinuousBatchingKVCacheManager(KVCacheManager[T]):
    """Slot-per-sequence manager (see module docstring). No prefix caching, one replica.

    Padded mode (``is_ragged=False``) needs the batch to hold slots 0..B-1 in
    order with equal cache lengths, and returns views of those slots.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[DeviceRef],
        session: Any,
        is_ragged: bool = False,
    ) -> None:
        super().__init__(params, max_batch_size, max_seq_len, num_layers, devices, session, is_ragged)
        if params.data_parallel_degree != 1:
            raise ValueError(
                f"data_parallel_degree={params.data_parallel_degree}: build one manager per replica (params.copy_as_dp_1(r))"
            )
        if params.enable_prefix_caching:
            raise ValueError("enable_prefix_caching=True: prefix caching needs PagedKVCacheManager")
        if params.is_mla and not is_ragged:
            raise ValueError("is_mla=True has no separate K and V caches; use is_ragged=True")
        self._slot_params = dataclasses.replace(params, page_size=max_seq_len)
        self.buffer = self._slot_params.allocate_buffers(max_batch_size + 1)[0]
        self.null_slot = max_batch_size

    def fetch(self, batch: list[T], num_steps: int = 1) -> list[KVCacheInputs]:
        """Per-device inputs for `batch`; every sequence must fit `len(tokens) + num_steps - 1` tokens."""
        check_int("num_steps", num_steps, 1)
        seq_ids = self._seq_ids(batch)
        for ctx in batch:
            need = len(ctx.tokens) + num_steps - 1
            if need > self.max_seq_len:
                raise InsufficientBlocksError(
                    f"request {ctx.request_id!r} needs {need} token slots; max_seq_len={self.max_seq_len}",
                    needed=need,
                    available=self.max_seq_len,
                )
        processed = [ctx.tokens.processed_length for ctx in batch]
        ends = [ctx.tokens.current_position for ctx in batch]
        max_prompt = max((e - p for p, e in zip(processed, ends, strict=True)), default=0)
        max_lengths = max_lengths_table(max_prompt, max(ends, default=0), num_steps)
        if self.is_ragged:
            return self._ragged(seq_ids, processed, max_lengths)
        return self._padded(seq_ids, processed)

    def _ragged(self, seq_ids: list[int], processed: list[int], max_lengths: torch.Tensor) -> list[KVCacheInputs]:
        lut = torch.full((len(seq_ids), lut_columns(1)), self.null_slot, dtype=torch.int32)
        lut[:, 0] = torch.tensor(seq_ids, dtype=torch.int32)
        lengths = torch.tensor(processed, dtype=torch.int32)
        scales: list[torch.Tensor | None] = (
            [*self.buffer.scales] if self.buffer.scales else [None] * len(self.buffer.values)
        )
        return [
            RaggedKVCacheInputs(
                blocks=values,
                cache_lengths=lengths.to(values.device, copy=True),
                lookup_table=lut.to(values.device, copy=True),
                max_lengths=max_lengths,
                kv_scales=s,
            ).with_policy(self.params.nonfinite_kv)
            for values, s in zip(self.buffer.values, scales, strict=True)
        ]

    def _padded(self, seq_ids: list[int], processed: list[int]) -> list[KVCacheInputs]:
        batch = len(seq_ids)
        if seq_ids != list(range(batch)):
            raise ValueError(f"padded batches must hold slots 0..{batch - 1} in order, got {seq_ids}")
        if len(set(processed)) > 1:
            raise ValueError(f"padded batches need equal cache lengths, got {processed}")
        start = processed[0] if processed else 0
        return [
            PaddedKVCacheInputs(
                k_cache=values[:batch, 0],  # [B, L, S, H, D] view
                v_cache=values[:batch, 1],  # [B, L, S, H, D] view
                start_pos=torch.tensor(start, dtype=torch.int64, device=values.device),
                null_op=torch.empty(0, device=values.device),
            )
            for values in self.buffer.values
        ]

    def input_symbols(self) -> Sequence[KVCacheInputSymbols]:
        """Per-device symbols in `fetch` order."""
        if self.is_ragged:
            return self._slot_params.get_symbolic_inputs().inputs
        p = self.params
        shape = ("batch_size", p.num_layers, self.max_seq_len, p.n_kv_heads_per_device, p.head_dim)
        return [
            PaddedKVCacheInputSymbols(
                k_cache=TensorSpec(f"s{s}_k_cache", p.dtype, shape, device),
                v_cache=TensorSpec(f"s{s}_v_cache", p.dtype, shape, device),
                start_pos=TensorSpec(f"s{s}_start_pos", DType.int64, (), device),
                null_op=TensorSpec(f"s{s}_null_op", DType.float32, (0,), device),
            )
            for s, device in enumerate(p.devices)
        ]

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[DeviceRef],
        **kwargs: Any,
    ) -> int:
        """Bytes of ``max_batch_size + 1`` slots of `max_seq_len` tokens (the +1 is the null slot)."""
        check_redundant_args(params, num_layers, devices)
        check_int("max_batch_size", max_batch_size, 1)
        check_int("max_seq_len", max_seq_len, 1)
        return (max_batch_size + 1) * dataclasses.replace(params, page_size=max_seq_len).bytes_per_block

    @classmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParams,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[DeviceRef],
        **kwargs: Any,
    ) -> int:
        """Slots of `max_seq_len` that fit in `available_cache_memory` next to the null slot."""
        check_redundant_args(params, num_layers, devices)
        check_int("max_seq_len", max_seq_len, 1)
        check_int("available_cache_memory", available_cache_memory, 0)
        slot = dataclasses.replace(params, page_size=max_seq_len).bytes_per_block
        slots = available_cache_memory // slot - 1
        if slots < 1:
            raise InsufficientBlocksError(
                f"available_cache_memory={available_cache_memory} holds no slot of {slot} bytes besides the null slot",
                needed=2 * slot,
                available=available_cache_memory,
            )
        return slots
