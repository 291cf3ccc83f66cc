"""`KVCacheManager`: MAX's abstract slot-based manager (`max.nn.kv_cache.manager`).

A manager hands out integer sequence ids (`claim`), returns the KV inputs of
a batch of contexts bound to those ids (`fetch`), and takes them back
(`release`). `fetch(batch, num_steps=k)` reserves room for k tokens per
sequence so a model can run k decode steps on device, advancing the inputs
between steps with `increment_cache_lengths` and no host sync.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch

from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.dtype import DeviceRef
from pagedkv.params.kv import KVCacheParamInterface, KVCacheParams
from pagedkv.params.symbols import KVCacheInputSymbols
from pagedkv.params.validation import check_int
from pagedkv.runtime.inputs import KVCacheInputs, PaddedKVCacheInputs, RaggedKVCacheInputs

__all__ = ["KVCacheManager"]

T = TypeVar("T", bound=TextContext)


class KVCacheManager(ABC, Generic[T]):
    """Slot-based KV cache manager: `max_batch_size` sequences of up to `max_seq_len` tokens.

    Args:
        params: the cache description (one data-parallel replica).
        max_batch_size: number of sequence ids (slots).
        max_seq_len: longest sequence a slot holds.
        num_layers: must equal ``params.num_layers`` (MAX's signature repeats it; ValueError otherwise).
        devices: must equal ``params.devices`` (repeated likewise).
        session: MAX's `InferenceSession` slot, stored as `self.session` and never used:
            pagedkv allocates with torch. None or any object.
        is_ragged: return `RaggedKVCacheInputs` (True) or `PaddedKVCacheInputs` (False).
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
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be KVCacheParams, got {type(params).__name__}")
        check_int("max_batch_size", max_batch_size, 1)
        check_int("max_seq_len", max_seq_len, 1)
        check_redundant_args(params, num_layers, devices)
        if not isinstance(is_ragged, bool):
            raise TypeError(f"is_ragged={is_ragged!r} must be a bool")
        self.params = params
        self.session = session
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.is_ragged = is_ragged
        self.num_layers = params.num_layers
        self.devices: list[DeviceRef] = list(params.devices)
        self._claimed: set[int] = set()

    # ----------------------------------------------------------------- slots
    def claim(self, n: int) -> list[int]:
        """Reserve `n` sequence ids, lowest first. Raises InsufficientBlocksError if fewer remain."""
        check_int("n", n, 1)
        free = sorted(self.slots_remaining)
        if n > len(free):
            raise InsufficientBlocksError(
                f"claim(n={n}) but only {len(free)} of {self.max_batch_size} sequence slots remain",
                needed=n,
                available=len(free),
            )
        ids = free[:n]
        self._claimed.update(ids)
        return ids

    def external_claim(self, seq_ids: list[int]) -> None:
        """Reserve exactly `seq_ids` (chosen by the caller). All or nothing."""
        for seq_id in seq_ids:
            if type(seq_id) is not int or not 0 <= seq_id < self.max_batch_size:
                raise ValueError(f"seq_id={seq_id!r} must be an int in [0, {self.max_batch_size})")
            if seq_id in self._claimed:
                raise ValueError(f"seq_id={seq_id} is already claimed")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids={seq_ids} contains duplicates")
        self._claimed.update(seq_ids)

    def contains(self, seq_id: int) -> bool:
        """True while `seq_id` is claimed."""
        return seq_id in self._claimed

    def release(self, seq_id: int) -> None:
        """Return `seq_id` to the pool of free slots."""
        if seq_id not in self._claimed:
            raise ValueError(f"Attempted to release seq_id {seq_id!r} but it is not claimed")
        self._claimed.remove(seq_id)

    @property
    def slots_remaining(self) -> set[int]:
        """The sequence ids not claimed (a copy)."""
        return set(range(self.max_batch_size)) - self._claimed

    def _seq_ids(self, batch: Sequence[T]) -> list[int]:
        ids = []
        for ctx in batch:
            seq_id = ctx.cache_seq_id
            if seq_id is None or seq_id not in self._claimed:
                raise ValueError(f"request {ctx.request_id!r} has cache_seq_id={seq_id!r}, which is not claimed")
            ids.append(seq_id)
        if len(set(ids)) != len(ids):
            raise ValueError(f"batch repeats sequence ids: {ids}")
        return ids

    # ----------------------------------------------------------------- inputs
    @abstractmethod
    def fetch(self, batch: list[T], num_steps: int = 1) -> list[KVCacheInputs]:
        """KV inputs (one per device) for `batch`, with room for `num_steps` new tokens each."""

    def step(self, batch: list[T]) -> None:
        """Commit the batch's new tokens to the prefix cache (no-op without one); checks the ids."""
        self._seq_ids(batch)

    def increment_cache_lengths(
        self,
        kv_cache_inputs: Sequence[RaggedKVCacheInputs] | Sequence[PaddedKVCacheInputs],
        prev_model_inputs: Any,
    ) -> list[RaggedKVCacheInputs] | list[PaddedKVCacheInputs]:
        """Inputs for the next step of a multistep run, with tensor ops only (no host sync).

        Ragged: ``cache_lengths += diff(prev_model_inputs.input_row_offsets)``
        (int [batch + 1] row offsets of the step just run) and the first
        `max_lengths` row is dropped. Padded: ``start_pos += prev_model_inputs.tokens.shape[1]``.
        New records are returned; the given ones and the manager are unchanged.
        """
        if all(isinstance(i, RaggedKVCacheInputs) for i in kv_cache_inputs):
            offsets = getattr(prev_model_inputs, "input_row_offsets", None)
            if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1:
                raise TypeError("prev_model_inputs.input_row_offsets must be a 1-D tensor [batch + 1]")
            return [_advance_ragged(i, offsets) for i in kv_cache_inputs]  # type: ignore[arg-type]
        if all(isinstance(i, PaddedKVCacheInputs) for i in kv_cache_inputs):
            tokens = getattr(prev_model_inputs, "tokens", None)
            if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
                raise TypeError("prev_model_inputs.tokens must be a 2-D tensor [batch, seq]")
            step = tokens.shape[1]
            return [
                PaddedKVCacheInputs(i.k_cache, i.v_cache, i.start_pos + step, i.null_op)  # type: ignore[union-attr]
                for i in kv_cache_inputs
            ]
        raise TypeError("kv_cache_inputs must all be RaggedKVCacheInputs or all PaddedKVCacheInputs")

    @abstractmethod
    def input_symbols(self) -> Sequence[KVCacheInputSymbols]:
        """Symbolic per-device inputs, in the order `fetch` returns them."""

    def num_kv_inputs(self) -> int:
        """Tensors per device in a `fetch` result (4; 5 with FP8 scales in ragged mode)."""
        return 5 if self.is_ragged and self.params.quantized_kv_cache else 4

    # ----------------------------------------------------------------- planning
    @classmethod
    @abstractmethod
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
        """Bytes the cache takes for this configuration. `num_layers` and `devices` must match
        `params` (ValueError); `kwargs` are for subclasses and ignored here."""

    @classmethod
    @abstractmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParams,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[DeviceRef],
        **kwargs: Any,
    ) -> int:
        """Largest batch of `max_seq_len` sequences `available_cache_memory` bytes hold.
        `num_layers` and `devices` must match `params` (ValueError); `kwargs` are ignored."""


def check_redundant_args(params: KVCacheParamInterface, num_layers: Any, devices: Any) -> None:
    """MAX's planning signatures repeat `num_layers` and `devices`; they must match `params`
    (for a cache tree, `num_layers` is the sum over its caches)."""
    layers = sum(leaf.num_layers for leaf in params.leaves())
    check_int("num_layers", num_layers, 1)
    if num_layers != layers:
        raise ValueError(f"num_layers={num_layers} differs from params' {layers} layers")
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a sequence of DeviceRef, got {type(devices).__name__}")
    if tuple(devices) != tuple(params.devices):
        raise ValueError(f"devices={list(devices)} differ from params.devices={list(params.devices)}")


def _advance_ragged(inputs: RaggedKVCacheInputs, offsets: torch.Tensor) -> RaggedKVCacheInputs:
    lengths = inputs.cache_lengths
    if offsets.shape[0] != lengths.shape[0] + 1:
        raise ValueError(
            f"input_row_offsets has {offsets.shape[0]} entries; batch of {lengths.shape[0]} needs {lengths.shape[0] + 1}"
        )
    offsets = offsets.to(lengths.device, non_blocking=True)
    processed = (offsets[1:] - offsets[:-1]).to(lengths.dtype)  # [B]
    return RaggedKVCacheInputs(
        blocks=inputs.blocks,
        cache_lengths=lengths + processed,
        lookup_table=inputs.lookup_table,
        max_lengths=inputs.max_lengths[1:, :],
        kv_scales=inputs.kv_scales,
    ).with_policy(inputs.nonfinite_kv)
