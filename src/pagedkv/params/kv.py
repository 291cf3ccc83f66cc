"""`KVCacheParams`: the shape, sharding and policy of one model's KV cache.

Pure Python: nothing here imports torch. `allocate_buffers` is the one method
that reaches into the tensor layer, and it imports it only when called.

A page holds every layer's K and V for `page_size` tokens. Per device::

    values: [total_num_pages + 1, kv_dim, num_layers, page_size, n_kv_heads_per_device, head_dim]
    scales: [total_num_pages + 1, kv_dim, num_layers, page_size, n_kv_heads_per_device,
             ceil(head_dim / quantization_granularity)]          (FP8 only)

`kv_dim` is 2 (K, V) for MHA/GQA and 1 for MLA, whose latent is replicated on
every TP shard. MHA heads are split evenly across a replica's TP shards.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.dtype import DeviceRef, DType
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.symbols import KVCacheInputSymbols, ragged_symbols
from pagedkv.params.validation import (
    INT32_MAX,
    NONFINITE_KV,
    check_eviction,
    check_int,
    check_weights_version,
    normalize_hash_seed,
    validate_attention_kind,
    validate_partial_page_reuse,
)
from pagedkv.specs import AttentionSpec, attention_spec

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.runtime.buffers import KVCacheBuffer

__all__ = [
    "HASH_ALGOS",
    "BatchCharacteristics",
    "KVCacheParamInterface",
    "KVCacheParams",
    "KVCacheQuantizationConfig",
    "KVConnectorType",
    "split_into_groups",
]

HASH_ALGOS = ("sha256", "sha256_64", "xxh3_128")
_SCALE_DTYPES = (DType.float32, DType.float8_e8m0fnu)
_FP8_KV_DTYPES = (DType.float8_e4m3fn, DType.float8_e4m3fnuz)


class KVConnectorType(enum.StrEnum):
    """Where pages go below the device: nowhere, host memory, host+disk, or Redis."""

    null = "null"
    local = "local"
    tiered = "tiered"
    redis = "redis"


@dataclass(frozen=True)
class KVCacheQuantizationConfig:
    """FP8 KV cache scales: one `scale_dtype` value per `quantization_granularity` elements of head_dim."""

    scale_dtype: DType = DType.float32
    quantization_granularity: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.scale_dtype, DType):
            raise TypeError(f"scale_dtype={self.scale_dtype!r} must be a DType")
        check_int("quantization_granularity", self.quantization_granularity, 1)


def split_into_groups(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split `items` into `n` contiguous groups of equal size, in order (replica-major)."""
    size = len(items) // n
    return [list(items[i * size : (i + 1) * size]) for i in range(n)]


class KVCacheParamInterface:
    """Base class of every cache description the managers accept (MAX's `KVCacheParamInterface`):
    `KVCacheParams` (one cache) and `pagedkv.params.multi.MultiKVCacheParams` (a tree of caches
    sharing one page table). It holds no state; the surface below is what both provide.
    """

    __slots__ = ()

    if TYPE_CHECKING:  # declared for type checkers only: the subclasses define these as fields or properties

        @property
        def page_size(self) -> int: ...
        @property
        def data_parallel_degree(self) -> int: ...
        @property
        def devices(self) -> Sequence[DeviceRef]: ...
        @property
        def n_devices(self) -> int: ...
        @property
        def tensor_parallel_degree(self) -> int: ...
        @property
        def devices_per_replica(self) -> list[list[DeviceRef]]: ...
        @property
        def enable_prefix_caching(self) -> bool: ...
        @property
        def kv_connector(self) -> KVConnectorType | None: ...
        @property
        def kv_connector_config(self) -> Any: ...
        @property
        def host_kvcache_swap_space_gb(self) -> float | None: ...
        @property
        def num_eagle_speculative_tokens(self) -> int: ...
        @property
        def kv_hash_algo(self) -> str: ...
        @property
        def kv_hash_seed(self) -> bytes | None: ...
        @property
        def eviction_policy(self) -> str: ...
        @property
        def protected_fraction(self) -> float: ...
        @property
        def evict_leaves_first(self) -> bool: ...
        @property
        def weights_version(self) -> str | None: ...
        @property
        def commit_on_alloc(self) -> bool | None: ...
        @property
        def enable_partial_page_reuse(self) -> bool: ...
        @property
        def max_state_checkpoints(self) -> int | None: ...
        @property
        def bytes_per_block(self) -> int: ...
        @property
        def bytes_per_token(self) -> int: ...
        def leaves(self) -> list[KVCacheParams]: ...
        def copy_as_dp_1(self, replica_idx: int = 0) -> KVCacheParamInterface: ...
        def allocate_buffers(self, total_num_pages: int) -> list[Any]: ...
        def get_symbolic_inputs(self, prefix: str = "") -> Any: ...


@dataclass(frozen=True)
class BatchCharacteristics:
    """Upper-bound batch shape for `PagedKVCacheManager.runtime_inputs` (MAX's `BatchCharacteristics`).

    Every replica's inputs are prepared for these bounds (graph-capture replay, where every
    data-parallel replica runs the identical captured graph); a replica's real values must not
    exceed them (ValueError naming the field). Hashable.

    Attributes:
        batch_size: upper bound on the requests of one replica's batch (>= 1).
        max_prompt_length: upper bound on the longest active window (tokens run this step, >= 1).
        max_cache_valid_length: upper bound on the longest ``cached + active`` length (>= 1).
    """

    batch_size: int
    max_prompt_length: int
    max_cache_valid_length: int

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, INT32_MAX)
        check_int("max_prompt_length", self.max_prompt_length, 1, INT32_MAX)
        check_int("max_cache_valid_length", self.max_cache_valid_length, 1, INT32_MAX)
        if self.max_prompt_length > self.max_cache_valid_length:
            raise ValueError(
                f"max_prompt_length={self.max_prompt_length} exceeds max_cache_valid_length={self.max_cache_valid_length}"
            )


@dataclass(frozen=True)
class KVCacheParams(KVCacheParamInterface):
    """Configuration of one KV cache (MAX's `KVCacheParams`).

    Raises ValueError/TypeError at construction for anything the cache cannot
    honour; the message names the argument, its value and the limit.
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    num_layers: int
    devices: Sequence[DeviceRef]
    enable_prefix_caching: bool = False
    kv_connector: KVConnectorType | None = None
    kv_connector_config: KVConnectorConfig | None = None
    host_kvcache_swap_space_gb: float | None = None
    page_size: int = 128
    is_mla: bool = False
    num_q_heads: int | None = None
    data_parallel_degree: int = 1
    n_kv_heads_per_device: int = 0
    num_q_heads_per_device: int | None = None
    kvcache_quant_config: KVCacheQuantizationConfig | None = None
    num_eagle_speculative_tokens: int = 0
    kv_hash_algo: str = "sha256"
    kv_hash_seed: bytes | None = field(default=None, repr=False)
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    sink_tokens: int = 0
    is_cross_attention: bool = False
    eviction_policy: str = "lru"  # a name in `pagedkv.core.pool.EVICTION_POLICIES`: "lru", "slru", "lfu", "arc"...
    protected_fraction: float = 0.25  # pool share that may keep running requests' dropped window pages
    evict_leaves_first: bool = False  # never evict a page while its prefix-chain child stays cached
    enable_partial_page_reuse: bool = False  # copy a cached last partial page's matching tokens (copy-on-write)
    # pages a step will fill are hittable from `alloc` (vLLM's schedule-time caching); None: on with prefix
    # caching for a model of one KV cache group without partial-page reuse (True for several groups; models with
    # recurrent state refuse it)
    commit_on_alloc: bool | None = None
    weights_version: str | None = None  # folded into every hash chain's root (`set_weights_version` changes it live)
    nonfinite_kv: str = "pass"  # NaN/inf in stored KV: "pass" (stored as is) or "reject" (ValueError, nothing stored)
    max_state_checkpoints: int | None = (
        None  # recurrent-state checkpoints kept for prefix hits: with attention pages, a cap on how many runs
        # of pages they take (None: 2 per batch slot); a model of state layers only keeps this many extra
        # state rows (None: a third of what live rows leave of a byte budget, else 2 per batch slot)
    )

    def __post_init__(self) -> None:
        self._validate_scalars()
        devices = tuple(self.devices)
        if not devices or not all(isinstance(d, DeviceRef) for d in devices):
            raise TypeError(f"devices={self.devices!r} must be a non-empty sequence of DeviceRef")
        object.__setattr__(self, "devices", devices)
        self._validate_parallelism(len(devices))
        self._validate_connector()
        validate_partial_page_reuse(self)
        if self.commit_on_alloc and not self.enable_prefix_caching:
            raise ValueError("commit_on_alloc=True requires enable_prefix_caching=True")
        self._validate_quantization()
        validate_attention_kind(self)
        from pagedkv.core.pool import EVICTION_POLICIES  # (lazy: the pool's registry names the policies)

        check_eviction(self.eviction_policy, self.protected_fraction, self.evict_leaves_first, EVICTION_POLICIES)
        if self.kv_hash_algo not in HASH_ALGOS:
            raise ValueError(f"kv_hash_algo={self.kv_hash_algo!r} must be one of {HASH_ALGOS}")
        object.__setattr__(self, "kv_hash_seed", normalize_hash_seed(self.kv_hash_seed, resolve_default=True))
        check_weights_version(self.weights_version)
        if self.max_state_checkpoints is not None:
            check_int("max_state_checkpoints", self.max_state_checkpoints, 0, INT32_MAX)
        if self.nonfinite_kv not in NONFINITE_KV:
            raise ValueError(f"nonfinite_kv={self.nonfinite_kv!r} must be one of {NONFINITE_KV}")
        tp = self.tensor_parallel_degree
        per_device = 1 if self.is_mla else self.n_kv_heads // tp
        object.__setattr__(self, "n_kv_heads_per_device", per_device)
        q_per_device = None if self.num_q_heads is None else self.num_q_heads // tp
        object.__setattr__(self, "num_q_heads_per_device", q_per_device)

    def _validate_scalars(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype={self.dtype!r} must be a pagedkv.DType")
        for name in ("n_kv_heads", "head_dim", "num_layers", "page_size", "data_parallel_degree"):
            check_int(name, getattr(self, name), 1)
        check_int("num_eagle_speculative_tokens", self.num_eagle_speculative_tokens, 0)
        if self.num_q_heads is not None:
            check_int("num_q_heads", self.num_q_heads, 1)
        for name in ("enable_prefix_caching", "is_mla", "enable_partial_page_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.commit_on_alloc is not None and not isinstance(self.commit_on_alloc, bool):
            raise TypeError(f"commit_on_alloc={self.commit_on_alloc!r} must be a bool or None (on with prefix caching)")

    def _validate_parallelism(self, n_devices: int) -> None:
        dp = self.data_parallel_degree
        if n_devices < dp:
            raise ValueError(
                f"Data parallelism degree ({dp}) cannot be greater than the number of devices ({n_devices})"
            )
        if n_devices % dp != 0:
            raise ValueError(f"Number of devices ({n_devices}) must be divisible by data parallelism degree ({dp})")
        tp = n_devices // dp
        if self.is_mla:
            if self.num_q_heads is None:
                raise ValueError("is_mla=True needs num_q_heads (the query head count)")
            if self.n_kv_heads != 1:
                raise ValueError(f"n_kv_heads={self.n_kv_heads} must be 1 for MLA (one latent per token)")
            if self.num_q_heads % tp != 0:
                raise ValueError(
                    f"Number of query heads ({self.num_q_heads}) must be divisible by the tensor parallel degree ({tp})"
                )
            return
        if self.n_kv_heads % tp != 0:
            raise ValueError(
                f"Number of KV heads ({self.n_kv_heads}) must be divisible by the tensor parallel degree ({tp})"
            )
        if self.num_q_heads is not None and self.num_q_heads % self.n_kv_heads != 0:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (GQA)")

    def _validate_connector(self) -> None:
        connector = self.kv_connector
        if connector is not None and not isinstance(connector, KVConnectorType):
            try:
                connector = KVConnectorType(connector)
            except ValueError:
                names = [c.value for c in KVConnectorType]
                raise ValueError(f"kv_connector={self.kv_connector!r} must be one of {names}") from None
            object.__setattr__(self, "kv_connector", connector)
        swap = self.host_kvcache_swap_space_gb
        if swap is not None and (not isinstance(swap, int | float) or isinstance(swap, bool) or not 0 < swap < 2**40):
            raise ValueError(f"host_kvcache_swap_space_gb={swap!r} must be a finite number > 0 (below 2**40)")
        if connector in (KVConnectorType.local, KVConnectorType.tiered, KVConnectorType.redis):
            if not self.enable_prefix_caching:
                raise ValueError(f"kv_connector={connector.value} requires prefix caching to be enabled")
        if connector in (KVConnectorType.local, KVConnectorType.tiered) and swap is None:
            raise ValueError(f"kv_connector={connector.value} requires host_kvcache_swap_space_gb to be set")
        config = self.kv_connector_config
        if config is not None and not isinstance(config, KVConnectorConfig):
            raise TypeError(f"kv_connector_config={config!r} must be a KVConnectorConfig or None")
        if connector is KVConnectorType.tiered and (config is None or config.disk_offload_dir is None):
            raise ValueError("kv_connector=tiered requires kv_connector_config=KVConnectorConfig(disk_offload_dir=...)")
        if connector is KVConnectorType.redis and (config is None or config.redis_url is None):
            raise ValueError("kv_connector=redis requires kv_connector_config=KVConnectorConfig(redis_url=...)")

    def _validate_quantization(self) -> None:
        qc = self.kvcache_quant_config
        if qc is None:
            return
        if not isinstance(qc, KVCacheQuantizationConfig):
            raise TypeError(f"kvcache_quant_config={qc!r} must be a KVCacheQuantizationConfig")
        if self.dtype not in _FP8_KV_DTYPES:
            raise ValueError(f"kvcache_quant_config is set but dtype={self.dtype.name} is not an FP8 KV dtype")
        if self.quantized_kv_cache and self.head_dim % qc.quantization_granularity != 0:
            raise ValueError(
                f"head_dim={self.head_dim} must be divisible by "
                f"quantization_granularity={qc.quantization_granularity} for an FP8 KV cache"
            )

    # ----------------------------------------------------------------- derived values
    @property
    def n_devices(self) -> int:
        """Number of devices, over every replica."""
        return len(self.devices)

    @property
    def tensor_parallel_degree(self) -> int:
        """Devices per data-parallel replica."""
        return self.n_devices // self.data_parallel_degree

    @property
    def devices_per_replica(self) -> list[list[DeviceRef]]:
        """The devices of each replica, replica-major and contiguous."""
        return split_into_groups(self.devices, self.data_parallel_degree)

    @property
    def kv_cache_spec(self) -> AttentionSpec:
        """This cache's per-layer spec (vLLM's `kv_cache_interface`): its type is the attention kind the
        bookkeeping serves (full, MLA, sliding window, chunked local, sinks + window, cross-attention).
        Page bytes are per layer and per replica's whole TP group."""
        return attention_spec(
            block_size=self.page_size, num_kv_heads=self.n_kv_heads, head_size=self.head_dim, dtype=self.dtype,
            is_mla=self.is_mla, sliding_window=self.sliding_window, attention_chunk_size=self.attention_chunk_size,
            sink_tokens=self.sink_tokens, is_cross_attention=self.is_cross_attention,
        )  # fmt: skip

    @property
    def attention_kind(self) -> str:
        """Which tokens this cache keeps, from its spec: "full", "sliding", "chunked", "sink" (sinks + window)
        or "cross"."""
        return self.kv_cache_spec.kind

    @property
    def kv_dim(self) -> int:
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.is_mla else 2

    @property
    def replicates_kv_across_tp(self) -> bool:
        """True when every TP shard holds the same pages (MLA with TP > 1)."""
        return self.is_mla and self.tensor_parallel_degree > 1

    @property
    def quantized_kv_cache(self) -> bool:
        """True when pages are FP8 with a valid scale dtype, so a scales buffer exists."""
        qc = self.kvcache_quant_config
        return self.dtype in _FP8_KV_DTYPES and qc is not None and qc.scale_dtype in _SCALE_DTYPES

    @property
    def is_fp8_kv_dtype(self) -> bool:
        """True when the storage dtype is FP8, whatever the scale configuration."""
        return self.dtype in _FP8_KV_DTYPES

    @property
    def dtype_shorthand(self) -> str:
        """ "bf16" for bfloat16, "f32" otherwise (MAX's definition, kept exactly)."""
        return "bf16" if self.dtype == DType.bfloat16 else "f32"

    @property
    def shape_per_block(self) -> list[int]:
        """One device's page: [kv_dim, num_layers, page_size, n_kv_heads_per_device, head_dim]."""
        return [self.kv_dim, self.num_layers, self.page_size, self.n_kv_heads_per_device, self.head_dim]

    @property
    def shape_per_scale_block(self) -> list[int]:
        """One device's FP8 scale page: the last dim is ceil(head_dim / granularity)."""
        gran = self.kvcache_quant_config.quantization_granularity if self.kvcache_quant_config else 128
        return [*self.shape_per_block[:-1], math.ceil(self.head_dim / gran)]

    @property
    def bytes_per_block_per_device(self) -> int:
        """Bytes of one page on one device, scales included."""
        total = math.prod(self.shape_per_block) * self.dtype.size_in_bytes
        if self.quantized_kv_cache:
            assert self.kvcache_quant_config is not None
            scale_bytes = self.kvcache_quant_config.scale_dtype.size_in_bytes
            total += math.prod(self.shape_per_scale_block) * scale_bytes
        return total

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one page over the whole TP group of a replica (MLA counts each replica copy)."""
        return self.bytes_per_block_per_device * self.tensor_parallel_degree

    @property
    def bytes_per_token(self) -> int:
        """`bytes_per_block / page_size` rounded up."""
        return -(-self.bytes_per_block // self.page_size)

    def leaves(self) -> list[KVCacheParams]:
        """The caches of this model: just this one (`MultiKVCacheParams` has several)."""
        return [self]

    # ----------------------------------------------------------------- constructors
    def copy_as_dp_1(self, replica_idx: int = 0) -> KVCacheParams:
        """These params restricted to replica `replica_idx`'s devices, with data_parallel_degree=1."""
        dp = self.data_parallel_degree
        if not isinstance(replica_idx, int) or not 0 <= replica_idx < dp:
            raise ValueError(f"replica_idx={replica_idx!r} must be in [0, {dp})")
        devices = self.devices_per_replica[replica_idx]
        return dataclasses.replace(self, devices=devices, data_parallel_degree=1)

    def allocate_buffers(self, total_num_pages: int) -> list[KVCacheBuffer]:
        """Zeroed page buffers with `total_num_pages` pages, one `KVCacheBuffer` per replica.

        The caller decides whether the null page is among them
        (`PagedKVCacheManager` passes its page count + 1).
        """
        from pagedkv.runtime.buffers import allocate_kv_buffers

        return allocate_kv_buffers(self, total_num_pages)

    def get_symbolic_inputs(self, prefix: str = "") -> KVCacheInputSymbols:
        """Symbolic per-device inputs, replica-major, in the order of `runtime_inputs`."""
        return ragged_symbols(self, prefix)
