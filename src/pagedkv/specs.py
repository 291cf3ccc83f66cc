"""KV cache specs of one layer, vLLM's `vllm.v1.kv_cache_interface`, torch-free.

A spec says what one layer stores per token and how many tokens it keeps:
full attention keeps every token; a sliding window keeps the last W; chunked
local attention keeps the current chunk; cross-attention keeps the encoder's
tokens once; MLA stores one latent per token. Specs are frozen dataclasses
whose dtypes are `pagedkv.DType`, so the bookkeeping layer can hold them (a
`torch.dtype` is accepted and converted; torch is imported only then).
Page sizes are in bytes for one layer and one page of `block_size` tokens.

The spec is where a cache's attention kind lives: `KVCacheParams.kv_cache_spec`
builds it (`attention_spec`, the one place that reads the window, chunk, sink
and cross-attention fields), and the bookkeeping picks each group's page
policy from the spec's type. `pagedkv.interface` re-exports every name here
with vLLM's grouping and pool-layout functions.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedkv.dtype import DType

__all__ = [
    "KVQuantMode", "get_kv_quant_mode", "kv_cache_uses_per_token_head_scales", "KVCacheSpec", "AttentionSpec",
    "FullAttentionSpec", "TQFullAttentionSpec", "MLAAttentionSpec", "HiddenStateCacheSpec", "SinkFullAttentionSpec",
    "SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec",
    "UniformTypeKVCacheSpecs", "SchedulerLimits", "attention_spec", "MambaSpec", "MAMBA_TYPES", "MAMBA_CACHE_MODES",
]  # fmt: skip

S = TypeVar("S", bound="KVCacheSpec")


def _to_dtype(dtype: Any) -> DType:
    """`dtype` as a `DType`: a `torch.dtype` is converted (torch is imported only for this)."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a pagedkv.DType or a torch.dtype")
    return DType.from_torch(dtype)


class KVQuantMode(enum.IntEnum):
    """How a KV cache is quantized, for kernels that dispatch on it."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3

    @property
    def is_per_token_head(self) -> bool:
        """True when every (token, head) carries its own scale."""
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD)


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """The `KVQuantMode` of a vLLM-style ``kv_cache_dtype`` string ("auto", "fp8", "fp8_per_token_head", ...)."""
    if kv_cache_dtype == "int8_per_token_head":
        return KVQuantMode.INT8_PER_TOKEN_HEAD
    if kv_cache_dtype == "fp8_per_token_head":
        return KVQuantMode.FP8_PER_TOKEN_HEAD
    if kv_cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


def kv_cache_uses_per_token_head_scales(kv_cache_dtype: str) -> bool:
    """True when ``kv_cache_dtype`` needs a scale per (token, head)."""
    return get_kv_quant_mode(kv_cache_dtype).is_per_token_head


@dataclass(frozen=True)
class SchedulerLimits:
    """What bounds a request's memory: `max_model_len` tokens, `max_num_batched_tokens` per step,
    `max_num_encoder_input_tokens` for cross-attention (stands in for vLLM's `VllmConfig`)."""

    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_encoder_input_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV cache format of one layer: `block_size` tokens per page."""

    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be an int >= 1")

    # RFC #42082 vocabulary: a page holds block_size / tokens_per_state states of
    # num_heads heads, each state_content_size_bytes bytes.
    @property
    def num_heads(self) -> int:
        """Heads a state is split into (1 when headless, e.g. MLA)."""
        return 1

    @property
    def tokens_per_state(self) -> int:
        """Tokens one state covers: 1 standard (a state per token), N compressed, -1 infinite (recurrent)."""
        return 1

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one state of one head (no page padding): here a token's share of the page."""
        return self.real_page_size_bytes // self.block_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page (padding included)."""
        raise NotImplementedError

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes the page's content needs (no padding)."""
        return self.page_size_bytes

    def max_memory_usage_bytes(self, vllm_config: SchedulerLimits) -> int:
        """Most bytes one request can hold in this layer. `vllm_config` is named as in vLLM
        and takes the `SchedulerLimits` that stand in for vLLM's `VllmConfig`."""
        return self.max_admission_blocks_per_request(vllm_config) * self.page_size_bytes

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        """Most pages one request holds at once (admission gate and pool sizing agree on it)."""
        return math.ceil(limits.max_model_len / self.block_size)

    def copy_with_new_block_size(self: S, block_size: int) -> S:
        """This spec with another page size in tokens."""
        return dataclasses.replace(self, block_size=block_size)

    @classmethod
    def merge(cls: type[S], specs: list[S]) -> S:
        """One spec for a group of layers; they must all be equal."""
        if not specs or any(s != specs[0] for s in specs[1:]):
            raise ValueError(f"all layers of a KV cache group must have the same spec, got {specs}")
        return specs[0]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """K and V of `num_kv_heads` heads of `head_size` (values `head_size_v`) in `dtype`."""

    num_kv_heads: int
    head_size: int
    dtype: DType
    head_size_v: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", _to_dtype(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(f"page_size_padded={self.page_size_padded} < real page size {self.real_page_size_bytes}")

    @property
    def kind(self) -> str:
        """The manager that serves this spec: full, sliding, chunked, sink, cross."""
        return "full"

    @property
    def kv_dim(self) -> int:
        """Tensors per token: 2 (K, V) or 1 (MLA latent)."""
        return 2

    @property
    def real_page_size_bytes(self) -> int:
        assert self.head_size_v is not None
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype.size_in_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self._content_page_bytes

    @property
    def _content_page_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.kv_quant_mode.is_per_token_head:  # a float32 scale per (token, head) for K and for V
            real += 2 * self.block_size * self.num_kv_heads * 4
        return real

    @property
    def num_heads(self) -> int:
        """KV heads (`num_kv_heads`); 1 for the headless MLA specs."""
        return self.num_kv_heads

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one token of one head: K and V (or the latent), plus per-(token, head) scales;
        ``block_size * num_heads * state_content_size_bytes`` is the unpadded page."""
        return self._content_page_bytes // (self.block_size * self.num_heads)

    def copy_with_new_block_size(self: S, block_size: int) -> S:
        padded = self.page_size_padded  # type: ignore[attr-defined]
        if padded is None:
            return dataclasses.replace(self, block_size=block_size)
        scaled = padded * block_size // self.block_size
        return dataclasses.replace(self, block_size=block_size, page_size_padded=scaled)  # type: ignore[call-arg]


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token is kept. `sliding_window` / `attention_chunk_size` are recorded when such a layer
    is served as full attention (no hybrid allocation): pages for all tokens, windowed compute."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    @classmethod
    def merge(cls: type[S], specs: list[S]) -> S:
        """One spec for a group: equal attention fields, at most one window size and one chunk size."""
        if not specs or not all(isinstance(s, FullAttentionSpec) for s in specs):
            raise ValueError("every layer of a full-attention group must be a FullAttentionSpec")
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}  # type: ignore[attr-defined]
        chunks = {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None}  # type: ignore[attr-defined]
        if len(windows) > 1 or len(chunks) > 1:
            raise ValueError(f"one group needs one window size and one chunk size, got {windows} and {chunks}")
        if windows and chunks:
            raise ValueError("a group cannot mix sliding window and chunked local attention")
        merged = dataclasses.replace(  # type: ignore[call-arg]
            specs[0], sliding_window=next(iter(windows), None), attention_chunk_size=next(iter(chunks), None)
        )
        base = {f.name for f in dataclasses.fields(AttentionSpec)}
        for spec in specs:
            if type(spec) is not type(merged) or any(getattr(spec, n) != getattr(merged, n) for n in base):
                raise ValueError(f"all layers of a group must have the same attention spec: {spec} vs {merged}")
        return merged


@dataclass(frozen=True, kw_only=True)
class TQFullAttentionSpec(FullAttentionSpec):
    """Full attention in a packed format: `tq_slot_size` bytes per (token, head) when set."""

    tq_slot_size: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return super().real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class _LatentSpec(AttentionSpec):
    """What MLA specs share: one latent of `head_size` per token, no separate V, no heads."""

    cache_dtype_str: str | None = None

    @property
    def kv_dim(self) -> int:
        return 1

    @property
    def num_heads(self) -> int:
        """1: the latent is headless."""
        return 1

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype.size_in_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(_LatentSpec, FullAttentionSpec):
    """Multi-head latent attention: one latent of `head_size` per token (no separate V)."""


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker: hidden states kept in the KV pool (one vector per token), in a group of their own."""


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Attention that always keeps the first `sink_len` tokens (attention sinks), plus, when
    `sliding_window` is set, the last W (StreamingLLM); pages between them return to the pool."""

    sink_len: int = 0

    @property
    def kind(self) -> str:
        return "sink" if self.sliding_window is not None else "full"

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        """The sink pages plus a sliding window's pages (all pages when there is no window)."""
        if self.sliding_window is None:
            return super().max_admission_blocks_per_request(limits)
        tokens = min(self.sliding_window - 1 + limits.max_num_batched_tokens, limits.max_model_len)
        return math.ceil(self.sink_len / self.block_size) + math.ceil(tokens / self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token sees the last `sliding_window` tokens (itself included); older pages are freed."""

    sliding_window: int

    @property
    def kind(self) -> str:
        return "sliding"

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        """The window (W - 1 computed tokens) plus one step's new tokens, +1 page of misalignment."""
        tokens = min(self.sliding_window - 1 + limits.max_num_batched_tokens, limits.max_model_len)
        return math.ceil(tokens / self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(_LatentSpec, SlidingWindowSpec):
    """A sliding window over MLA latents (one latent per token)."""


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Llama 4 local attention: a token sees its own chunk of `attention_chunk_size` tokens."""

    attention_chunk_size: int

    @property
    def kind(self) -> str:
        return "chunked"

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        """One chunk of computed tokens plus one step's new tokens, +1 page of misalignment."""
        tokens = min(self.attention_chunk_size + limits.max_num_batched_tokens, limits.max_model_len)
        return math.ceil(tokens / self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross-attention: the encoder's K/V, written once per request."""

    @property
    def kind(self) -> str:
        return "cross"

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        return math.ceil(limits.max_num_encoder_input_tokens / self.block_size)


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type (same token slots) with different shapes: one group, pages summed."""

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        return max(s.max_admission_blocks_per_request(limits) for s in self.kv_cache_specs.values())

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """True when every layer needs the same token slots (same kind, window, chunk and block size)."""
        keys = {_slot_key(s) for s in kv_cache_specs.values()}
        return len(keys) == 1

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """One spec for all layers if they are of a uniform type, else None."""
        if not kv_cache_specs or not cls.is_uniform_type(kv_cache_specs):
            return None
        block = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block, kv_cache_specs=dict(kv_cache_specs))


MAMBA_TYPES = ("mamba1", "mamba2", "short_conv", "linear", "gdn_attn")
"""`MambaSpec.mamba_type` values: vLLM's `MambaAttentionBackendEnum` names, lower case."""

MAMBA_CACHE_MODES = ("none", "align")
"""`MambaSpec.mamba_cache_mode` values: "none" (one live state per request, updated in place) or "align"
(vLLM's prefix-caching mode: states at block boundaries)."""


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """A recurrent layer's state (Mamba, Mamba2, gated delta net, short conv): a fixed size per request.

    `shapes[i]` / `dtypes[i]` describe state tensor i of ONE layer (e.g. conv ``(C, K - 1)`` and
    SSM ``(H, P, N)``), for a replica's whole TP group, as pagedkv's attention specs count every KV
    head; a TP shard holds ``shapes[i][0] // tp`` rows of each (`shard`) unless `tp_replicated`
    (every shard holds the whole state). A state slot is one page of the layer's group: the page
    holds one state, whatever `block_size` says, so `page_size_bytes` does not depend on it
    (`page_size_padded` pads it to the pool's unified page). `num_speculative_blocks` draft slots come
    on top of the live one. `tokens_per_state` is -1 (a state covers every token so far).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[DType, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    num_heads: int = 1  # type: ignore[assignment]
    tokens_per_state: int = -1  # type: ignore[assignment]
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shapes, tuple | list) or not all(isinstance(s, tuple | list) for s in self.shapes):
            raise TypeError(f"shapes={self.shapes!r} must be a tuple of shapes (tuples of ints), one per state tensor")
        shapes = tuple(tuple(shape) for shape in self.shapes)
        if not shapes or any(not s or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in s)
                             for s in shapes):  # fmt: skip
            raise ValueError(f"shapes={self.shapes!r} must be a non-empty tuple of shapes of positive ints")
        if not isinstance(self.dtypes, tuple | list):
            raise TypeError(f"dtypes={self.dtypes!r} must be a tuple of dtypes, one per state tensor")
        dtypes = tuple(d if isinstance(d, DType) else _to_dtype(d) for d in self.dtypes)
        if len(dtypes) != len(shapes):
            raise ValueError(f"dtypes has {len(dtypes)} entries but shapes has {len(shapes)}: one dtype per state")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.mamba_type not in MAMBA_TYPES:
            raise ValueError(f"mamba_type={self.mamba_type!r} must be one of {MAMBA_TYPES}")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode={self.mamba_cache_mode!r} must be one of {MAMBA_CACHE_MODES}")
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        for name in ("num_heads", "page_size_padded", "prefill_checkpoint_alignment"):
            value = getattr(self, name)
            if value is None and name != "num_heads":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.tp_replicated, bool):
            raise TypeError(f"tp_replicated={self.tp_replicated!r} must be a bool")
        if self.tokens_per_state != -1:
            raise ValueError(f"tokens_per_state={self.tokens_per_state!r} must be -1 for a recurrent state")
        if self.page_size_padded is not None and self.page_size_padded < self.state_content_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} < the state's {self.state_content_size_bytes} bytes"
            )

    @property
    def kind(self) -> str:
        """ "state": served by the state-slot manager (one slot per running request)."""
        return "state"

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes of one layer's state: the sum over its tensors (no padding)."""
        return sum(math.prod(s) * d.size_in_bytes for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def real_page_size_bytes(self) -> int:
        return self.state_content_size_bytes

    @property
    def page_size_bytes(self) -> int:
        """One state slot of one layer: the state, or `page_size_padded` when set."""
        return self.page_size_padded if self.page_size_padded is not None else self.state_content_size_bytes

    @property
    def slots_per_request(self) -> int:
        """State slots a running request holds: the live one plus `num_speculative_blocks` draft slots."""
        return 1 + self.num_speculative_blocks

    def max_memory_usage_bytes(self, vllm_config: SchedulerLimits) -> int:
        """One request's slots: ``page_size_bytes * (1 + num_speculative_blocks)`` ("none" mode), one more
        live slot plus the prefill checkpoints in "align" mode (vLLM's arithmetic). The mode is
        ``vllm_config.cache_config.mamba_cache_mode`` when the argument has one (as vLLM reads it), else
        this spec's `mamba_cache_mode`."""
        cache_config = getattr(vllm_config, "cache_config", None)
        mode = getattr(cache_config, "mamba_cache_mode", None) or self.mamba_cache_mode
        extra = 1 + self.num_prefill_checkpoint_blocks if mode == "align" else 0
        return self.page_size_bytes * (self.slots_per_request + extra)

    def max_admission_blocks_per_request(self, limits: SchedulerLimits) -> int:
        return self.max_memory_usage_bytes(limits) // self.page_size_bytes

    def copy_with_new_block_size(self: S, block_size: int) -> S:
        return dataclasses.replace(self, block_size=block_size)

    def shard(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """The state shapes one of `tp` shards holds: dim 0 split (heads or channels) unless `tp_replicated`.
        ValueError when dim 0 of a shape does not split evenly."""
        if self.tp_replicated or tp == 1:
            return self.shapes
        bad = [s for s in self.shapes if s[0] % tp]
        if bad:
            raise ValueError(f"state shapes {bad} do not split over tensor_parallel_degree={tp} (dim 0 % {tp} != 0)")
        return tuple((s[0] // tp, *s[1:]) for s in self.shapes)

    def shard_layout(self, tp: int = 1) -> list[tuple[int, tuple[int, ...], DType]]:
        """(byte offset, shape, dtype) of each state tensor of one layer on one of `tp` shards, packed in
        order, each offset a multiple of its dtype's size (so a byte buffer views as every tensor)."""
        out, offset = [], 0
        for shape, dtype in zip(self.shard(tp), self.dtypes, strict=True):
            size = dtype.size_in_bytes
            offset = -(-offset // size) * size
            out.append((offset, shape, dtype))
            offset += math.prod(shape) * size
        return out

    def shard_bytes(self, tp: int = 1) -> int:
        """Bytes of one layer's state on one of `tp` shards as `shard_layout` packs it, rounded up to the
        largest dtype size (so layers pack back to back): the content plus a few alignment bytes."""
        offset, shape, dtype = self.shard_layout(tp)[-1]
        end = offset + math.prod(shape) * dtype.size_in_bytes
        widest = max(d.size_in_bytes for d in self.dtypes)
        return -(-end // widest) * widest

    @classmethod
    def merge(cls: type[S], specs: list[S]) -> S:
        """One spec for a group of state layers: all equal."""
        if not specs or any(s != specs[0] for s in specs[1:]):
            raise ValueError(f"all state layers of a group must have the same spec, got {specs}")
        return specs[0]


def _slot_key(spec: KVCacheSpec) -> tuple[Any, ...]:
    """What decides which token slots a layer keeps (a recorded window does not: full keeps all)."""
    kind = spec.kind if isinstance(spec, AttentionSpec | MambaSpec) else type(spec).__name__
    if isinstance(spec, MambaSpec):  # one group type per state layout: a page of the group holds one state
        return (kind, spec.block_size, spec.shapes, spec.dtypes, spec.num_speculative_blocks, spec.tp_replicated)
    if kind in ("full", "cross"):
        return (kind, spec.block_size)
    window = getattr(spec, "sliding_window", None)
    return (kind, spec.block_size, window, getattr(spec, "attention_chunk_size", None), getattr(spec, "sink_len", 0))


def attention_spec(
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: DType,
    is_mla: bool = False,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    sink_tokens: int = 0,
    is_cross_attention: bool = False,
) -> AttentionSpec:
    """The spec of a cache with these attention fields (as `KVCacheParams` names them): cross-attention,
    chunked local, sinks + window, sliding window (MLA or not), or full attention (MLA or not).
    Page bytes are per layer, for `num_kv_heads` heads (a replica's whole TP group)."""
    common: dict[str, Any] = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    if is_cross_attention:
        return CrossAttentionSpec(**common)
    if attention_chunk_size is not None:
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=attention_chunk_size)
    if sliding_window is not None and sink_tokens:
        return SinkFullAttentionSpec(**common, sliding_window=sliding_window, sink_len=sink_tokens)
    if sliding_window is not None:
        return (SlidingWindowMLASpec if is_mla else SlidingWindowSpec)(**common, sliding_window=sliding_window)
    return (MLAAttentionSpec if is_mla else FullAttentionSpec)(**common)
