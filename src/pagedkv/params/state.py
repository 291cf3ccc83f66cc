"""`StateCacheParams`: the params of a group of recurrent-state layers (one `MambaSpec` per layer).

A state group is one more child of a `MultiKVCacheParams` tree, beside the
attention groups: it shares their page ids, page size, parallelism and
prefix-caching settings (the fields `MultiKVCacheParams` checks), and a page
id it owns holds one request's state of every layer of the group instead of
`page_size` tokens. Per device, a page is laid out as::

    [ layer 0: state 0 | state 1 | ... | layer 1: ... ]   (each tensor aligned to its dtype's size)

with state i of shape ``state_spec.shard(tp)[i]`` in ``state_spec.dtypes[i]``. The attention fields of
`KVCacheParams` (`dtype`, `n_kv_heads`, `head_dim`) are fixed: uint8 pages of one "head".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.dtype import DeviceRef, DType
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.symbols import KVCacheInputSymbols, state_symbols
from pagedkv.specs import MambaSpec

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.runtime.state_buffers import StateCacheBuffer

__all__ = ["StateCacheParams"]


@dataclass(frozen=True)
class StateCacheParams(KVCacheParams):
    """One group of state layers: `num_layers` layers, each holding `state_spec`'s tensors per slot.

    Build it with `StateCacheParams.from_spec`. A request holds ``state_spec.slots_per_request`` pages
    of the group while it runs (its live state slot and the draft slots). Raises ValueError when the
    spec's shapes do not split over the tensor parallel degree (unless ``state_spec.tp_replicated``).
    """

    state_spec: MambaSpec | None = None

    @classmethod
    def from_spec(
        cls, state_spec: MambaSpec, num_layers: int, devices: Sequence[DeviceRef], **kwargs: Any
    ) -> StateCacheParams:
        """A state group of `num_layers` layers with `state_spec`; `kwargs` are the shared `KVCacheParams`
        fields (``page_size``, ``enable_prefix_caching``, ``data_parallel_degree``, ...)."""
        kwargs.setdefault("page_size", state_spec.block_size)
        tp = len(devices) // kwargs.get("data_parallel_degree", 1) or 1
        return cls(dtype=DType.uint8, n_kv_heads=tp, head_dim=1, num_layers=num_layers, devices=devices,
                   state_spec=state_spec, **kwargs)  # fmt: skip

    def __post_init__(self) -> None:
        if not isinstance(self.state_spec, MambaSpec):
            raise TypeError(f"state_spec={self.state_spec!r} must be a MambaSpec")
        if self.is_mla or self.is_cross_attention or self.sliding_window or self.attention_chunk_size:
            raise ValueError("a state group has no attention fields (is_mla, is_cross_attention, windows, chunks)")
        if self.state_spec.mamba_cache_mode != "none":
            raise ValueError(f"state_spec.mamba_cache_mode={self.state_spec.mamba_cache_mode!r}: pagedkv keeps one "
                             "live state per request ('none') and its own token-granular state checkpoints "
                             "(KVCacheParams.max_state_checkpoints), not vLLM's block-aligned ones")  # fmt: skip
        if self.kvcache_quant_config is not None:
            raise ValueError("a state group is not FP8-quantized (kvcache_quant_config must be None)")
        super().__post_init__()
        self.state_spec.shard(self.tensor_parallel_degree)  # ValueError when the shapes do not split

    @property
    def spec(self) -> MambaSpec:
        """`state_spec`, typed."""
        assert self.state_spec is not None
        return self.state_spec

    @property
    def kv_cache_spec(self) -> MambaSpec:  # type: ignore[override]
        """The group's per-layer `MambaSpec`, its `block_size` the pool's page size."""
        spec = self.spec
        return spec if spec.block_size == self.page_size else dataclasses.replace(spec, block_size=self.page_size)

    @property
    def kv_dim(self) -> int:
        return 1

    @property
    def replicates_kv_across_tp(self) -> bool:
        """True when every TP shard holds the whole state (``tp_replicated`` with TP > 1)."""
        return self.spec.tp_replicated and self.tensor_parallel_degree > 1

    def state_layout(self) -> list[tuple[int, tuple[int, ...], DType]]:
        """(byte offset within a layer's share of the page, shard shape, dtype) of each state tensor
        (`MambaSpec.shard_layout` at this tensor parallel degree)."""
        return self.spec.shard_layout(self.tensor_parallel_degree)

    @property
    def layer_bytes_per_device(self) -> int:
        """Bytes one layer's state takes in a page on one device (`MambaSpec.shard_bytes`)."""
        return self.spec.shard_bytes(self.tensor_parallel_degree)

    @property
    def shape_per_block(self) -> list[int]:
        """One device's page as uint8: [num_layers, layer_bytes_per_device]."""
        return [self.num_layers, self.layer_bytes_per_device]

    @property
    def bytes_per_request(self) -> int:
        """State bytes one running request holds over a replica's TP group (slots x page bytes)."""
        return self.spec.slots_per_request * self.bytes_per_block

    def get_symbolic_inputs(self, prefix: str = "") -> KVCacheInputSymbols:
        """Symbolic per-device inputs in the order of `runtime_inputs`' `StateCacheInputs`, replica-major."""
        return state_symbols(self, prefix)

    def allocate_buffers(self, total_num_pages: int) -> list[StateCacheBuffer]:  # type: ignore[override]
        """Zeroed state pages, one `pagedkv.runtime.state_buffers.StateCacheBuffer` per replica."""
        from pagedkv.runtime.state_buffers import allocate_state_buffers

        return allocate_state_buffers(self, total_num_pages)
