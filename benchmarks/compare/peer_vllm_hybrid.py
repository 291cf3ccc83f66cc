"""vLLM 0.33's real hybrid `KVCacheManager` (Mamba "align" prefix caching) as a `CacheAdapter`.

The model is Qwen3.5-shaped (`HybridShape`, defaults = HF `Qwen3_5TextConfig`): 32 layers, every 4th full
attention (4 KV heads x 256, bf16), the other 24 gated delta nets (GDN) with a conv state (3, 8192) bf16 and
a recurrent state (32, 128, 128) fp32 per layer.

What is vLLM's own code and what is reproduced (paths under ``vllm/``, vLLM 0.33.0):

- Reused as is: `MambaStateShapeCalculator.gated_delta_net_state_shape` / `MambaStateDtypeCalculator.
  gated_delta_net_state_dtype` (``model_executor/layers/mamba/mamba_utils.py:122``, ``:272``, what
  `Qwen3_5ForCausalLM.get_mamba_state_*_from_config` return), `MambaSpec` / `FullAttentionSpec` and their page
  sizes, the layer grouping ``get_kv_cache_groups`` (``v1/core/kv_cache_planning.py:1113``: 3 GDN groups + 1
  attention group of 8 layers each), the pool's bytes per block ``_pool_bytes_per_block`` (``:251``) and the
  tensors ``get_kv_cache_config_from_groups`` (``:642``), ``resolve_kv_cache_block_sizes``
  (``v1/core/kv_cache_utils.py:816``: scheduler and hash block size, both 528), `KVCacheManager` with its
  `HybridKVCacheCoordinator`, `MambaManager`, `FullAttentionManager` and `BlockPool`, `Request` with vLLM's
  block hasher, and the scheduler's chunk split itself, `Scheduler._mamba_block_aligned_split`
  (``v1/core/sched/scheduler.py:546-662``), called on a stand-in `self` (see `_split_context`).
- Reproduced: the block-size arithmetic of `Platform._align_hybrid_block_size` (``platforms/interface.py:
  1066-1128``; `align_hybrid_block_size`), because vLLM runs it on a `VllmConfig` whose model class must be
  imported (``vllm/model_executor/models/qwen3_5.py`` needs ``einops``, absent from the CPU peer install, and
  the registry inspects it in a subprocess that cannot import torchvision there) and after the model's layers
  exist. The peer tests check it against the real function (and with ``einops`` installed, a real
  `VllmConfig` of a Qwen3.5 checkpoint config on CPU gives vLLM's function the same 528). Also reproduced:
  the attributes `Scheduler.__init__` derives for the split (``scheduler.py:139-143``, ``:218``,
  ``:342-350``, ``:432-466``), where the scheduler applies it and what it does with a 0 (running requests:
  ``:835-887``, the request is skipped this step; waiting requests: ``:1119-1127`` keep the shared-prefix
  boundary on the request, ``:1348-1357`` split, a 0 stops admitting), and the per-step drains at the end
  of `Scheduler.schedule` (``:1678-1700``, ``:1790-1797``).
- `VllmConfig`: a real one is not built (its `ModelConfig` needs the model class, above). vLLM's planning
  functions get a `SimpleNamespace` holding real `CacheConfig`, `SchedulerConfig`, `ParallelConfig` and
  `AttentionConfig` objects plus ``kv_transfer_config=None``: exactly the attributes they read.

GDN prefill backend: with "triton" (vLLM's "auto" choice on CPU and on CUDA GPUs other than SM90 and
SM100/SM120 with CUDA 13, or forced with ``--gdn-prefill-backend triton``) no layer exports prefill
checkpoints and the block is 528 tokens. With "flashinfer" (the "auto" choice on an SM90 GPU such as the
H100, ``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:148-270``) the GDN layers export a checkpoint every 64 tokens inside a prefill
(``:690-700``, ``:736-750``), the block becomes lcm(16, 64) * ceil(...) = 576 tokens, and each Mamba spec gets
one prefill checkpoint block, so the scheduler stops splitting the last prefill chunk at the last cacheable
boundary (``scheduler.py:587-606``): the backend saves that state from inside the chunk.

Not modelled (as in `VllmAdapter`): the scheduler's ``scheduler_reserve_full_isl`` admission gate (on by
default in 0.33, ``config/scheduler.py:190``: admission also requires the whole current sequence's blocks
to be free; both vLLM adapters admit on the first chunk's blocks), the watermark (0 by default),
speculative decoding, KV connectors, async scheduling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks.compare.peer_vllm import _block_hasher, _vllm
from benchmarks.compare.peers import import_peer
from pagedkv.workloads.traces import TraceRequest

__all__ = ["HybridShape", "QWEN35", "GDN_PREFILL_BACKENDS", "VllmHybridAdapter", "align_hybrid_block_size"]

GDN_PREFILL_BACKENDS = ("triton", "flashinfer")
_KERNEL_BLOCK_SIZE = (
    16  # FLASH_ATTN's smallest kernel block, MultipleOf(16) (v1/attention/backends/flash_attn.py:357-370)
)


@dataclass(frozen=True)
class HybridShape:
    """A GDN / full-attention hybrid; defaults are HF's `Qwen3_5TextConfig` (Qwen3.5-9B)."""

    num_layers: int = 32
    full_attention_interval: int = 4  # layer i is full attention when (i + 1) % interval == 0
    num_kv_heads: int = 4
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    dtype: str = "bfloat16"  # model and KV dtype (conv state too: mamba_cache_dtype "auto")
    mamba_ssm_dtype: str = "float32"  # Qwen3.5 configs carry it; vLLM adopts it (models/config.py:953-978)

    def layer_names(self) -> list[tuple[str, bool]]:
        """(vLLM layer name, is full attention) in model order."""
        out = []
        for i in range(self.num_layers):
            full = (i + 1) % self.full_attention_interval == 0
            out.append((f"model.layers.{i}.self_attn.attn" if full else f"model.layers.{i}.linear_attn", full))
        return out


QWEN35 = HybridShape()


def _load() -> SimpleNamespace:
    """vLLM's hybrid-specific classes and functions (raises PeerUnavailable when vLLM is missing)."""

    def load() -> SimpleNamespace:
        from vllm.config import AttentionConfig, CacheConfig, ParallelConfig, SchedulerConfig
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
        from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import MambaSpec

        return SimpleNamespace(
            AttentionConfig=AttentionConfig,
            CacheConfig=CacheConfig,
            ParallelConfig=ParallelConfig,
            SchedulerConfig=SchedulerConfig,
            MambaStateDtypeCalculator=MambaStateDtypeCalculator,
            MambaStateShapeCalculator=MambaStateShapeCalculator,
            FLASHINFER_GDN_CHECKPOINT_ALIGNMENT=FLASHINFER_GDN_CHECKPOINT_ALIGNMENT,
            GDN_ATTN=MambaAttentionBackendEnum.GDN_ATTN,
            record_kv_cache_layout=record_kv_cache_layout,
            resolve_kv_cache_block_sizes=resolve_kv_cache_block_sizes,
            split=Scheduler._mamba_block_aligned_split,
            MambaSpec=MambaSpec,
        )

    return import_peer("vLLM", load)


def align_hybrid_block_size(
    mamba_page_bytes: int,
    attn_page_bytes_per_token: int,
    kernel_block_size: int = _KERNEL_BLOCK_SIZE,
    checkpoint_alignment: int | None = None,
) -> int:
    """The attention block (tokens) vLLM's `Platform._align_hybrid_block_size` sets, for one attention backend.

    ``platforms/interface.py``: the kernel alignment is max(the backend's smallest kernel block, the block
    size picked before, which is that same preferred size) (:1066-1074), lcm'd in align mode with the Mamba
    layers' prefill checkpoint alignment (:1089-1094); the block is the alignment times
    ceil(mamba page / (alignment * one token's attention page)) (:1098-1101), rounded up to the backends'
    common kernel block (:1102-1104). The Mamba block and padded page follow it (:1114-1128).
    """
    alignment = kernel_block_size
    if checkpoint_alignment:
        alignment = math.lcm(alignment, checkpoint_alignment)
    block = alignment * -(-mamba_page_bytes // (alignment * attn_page_bytes_per_token))
    return kernel_block_size * -(-block // kernel_block_size)


@dataclass(frozen=True)
class _Plan:
    """vLLM's cache layout for one shape and backend choice (everything but the block count)."""

    block_size: int
    page_bytes: int
    mamba_state_bytes: int  # one GDN layer's conv + recurrent state, before padding to the page
    specs: dict[str, Any]  # layer name -> vLLM KVCacheSpec
    vllm_config: SimpleNamespace
    groups: list[Any]  # vLLM KVCacheGroupSpec
    bytes_per_block: int


def _plan(
    shape: HybridShape,
    gdn_prefill_backend: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    retention_interval: int | None,
    hash_name: str,
) -> _Plan:
    if gdn_prefill_backend not in GDN_PREFILL_BACKENDS:
        raise ValueError(f"gdn_prefill_backend must be one of {GDN_PREFILL_BACKENDS}, got {gdn_prefill_backend!r}")
    v, h = _vllm(), _load()
    torch = v.torch
    dtype = getattr(torch, shape.dtype)
    # What Qwen3_5ForCausalLM.get_mamba_state_{shape,dtype}_from_config return at TP 1, no spec decode.
    shapes = h.MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, shape.linear_num_key_heads, shape.linear_num_value_heads, shape.linear_key_head_dim,
        shape.linear_value_head_dim, shape.linear_conv_kernel_dim, 0,
    )  # fmt: skip
    dtypes = h.MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtype, "auto", shape.mamba_ssm_dtype)
    mamba_bytes = h.MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes  # interface.py:1057-1061
    attn_1 = v.FullAttentionSpec(
        block_size=1, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim, dtype=dtype
    ).page_size_bytes  # interface.py:1032-1043 (FLASH_ATTN's customize_spec is the identity)
    flashinfer = gdn_prefill_backend == "flashinfer"
    ckpt_alignment = h.FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if flashinfer else None
    block = align_hybrid_block_size(mamba_bytes, attn_1, checkpoint_alignment=ckpt_alignment)
    page = block * attn_1

    # Real config objects; prefix caching on => mamba_cache_mode "align" (model_executor/models/config.py:763-779).
    cache_config = h.CacheConfig(
        block_size=block, enable_prefix_caching=True, prefix_caching_hash_algo=hash_name,
        mamba_cache_mode="align", mamba_block_size=block, mamba_page_size_padded=page,
        mamba_ssm_cache_dtype=shape.mamba_ssm_dtype, prefix_cache_retention_interval=retention_interval,
    )  # fmt: skip
    h.record_kv_cache_layout(cache_config, "LBNHC")  # the default preference (v1/attention/backends/utils.py:229)
    scheduler_config = h.SchedulerConfig(
        max_model_len=max_model_len, is_encoder_decoder=False, max_num_batched_tokens=max_num_batched_tokens
    )
    vllm_config = SimpleNamespace(
        cache_config=cache_config, scheduler_config=scheduler_config, parallel_config=h.ParallelConfig(),
        attention_config=h.AttentionConfig(), kv_transfer_config=None,
    )  # fmt: skip

    # MambaBase.get_kv_cache_spec (model_executor/layers/mamba/abstract.py:72-91); with FlashInfer checkpoints
    # QwenGatedDeltaNetAttention adds one checkpoint block on the prefix-cache grid (qwen_gdn_linear_attn.py:739-750,
    # abstract.py get_mamba_prefill_checkpoint_grid = mamba_block_size when prefix_match_unit is unset).
    mamba_spec = h.MambaSpec(
        shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=page, mamba_type=h.GDN_ATTN,
        mamba_cache_mode="align", num_speculative_blocks=0,
        num_prefill_checkpoint_blocks=int(flashinfer), prefill_checkpoint_alignment=block if flashinfer else None,
    )  # fmt: skip
    attn_spec = v.FullAttentionSpec(block_size=block, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                                    dtype=dtype)  # fmt: skip
    specs = {name: attn_spec if full else mamba_spec for name, full in shape.layer_names()}
    groups = v.kv_cache_planning.get_kv_cache_groups(vllm_config, specs)
    bytes_per_block = v.kv_cache_planning._pool_bytes_per_block(vllm_config, groups)
    return _Plan(block, page, mamba_bytes, specs, vllm_config, groups, bytes_per_block)


class VllmHybridAdapter:
    """vLLM's hybrid `KVCacheManager` in Mamba align mode behind the `CacheAdapter` protocol.

    `num_pages` is the number of usable vLLM blocks of the unified page (each block holds, per group slot,
    one 528-token attention page or one padded GDN state); vLLM's `KVCacheConfig.num_blocks` is one more,
    block 0 being its null block (as in `VllmAdapter`). `blocks_for_bytes` / `from_bytes` convert a byte
    budget the way vLLM's planner does (num_blocks = bytes // bytes per block, `bytes_per_block` = unified
    page x 8 layers per group slot = 17,301,504 B for Qwen3.5).

    The driver's calls map to vLLM's scheduler as in `VllmAdapter`, plus the align-mode chunk split:

    - admit: ``get_computed_blocks`` (its shared-prefix boundary is stored on the request, as the scheduler
      does at ``scheduler.py:1119-1127``), chunk = min(uncached, budget) clipped by vLLM's
      ``_mamba_block_aligned_split(req, n, hit, 0)`` (``:1348-1357``); a 0 returns None (vLLM ``break``s),
      else ``allocate_slots(req, n, hit, blocks)``. A block another request cached this step makes vLLM
      refuse the allocation (``single_type_kv_cache_manager.py:1704-1712``): None, retried next step.
    - clip_chunk (running requests, asked by the driver before extend): the split of
      ``min(remaining, budget)`` (``:835-863``); 0 skips the request this step (``:871-887``).
    - extend: ``allocate_slots(req, n) is not None``.
    - advance: ``num_computed_tokens += n``, sampled tokens appended (hashing blocks as they fill), then the
      drains ``Scheduler.schedule`` ends with: boundary-state offloads, copy-on-write copies (their retained
      blocks freed, the step being over) and new block ids.
    - free, used_pages, prefix_cache_stats: as `VllmAdapter`.

    ``retention_interval`` is vLLM's ``prefix_cache_retention_interval``: 0 (its default) keeps only the
    Mamba states at the prompt's replay boundary and at detected shared-prefix junctions, None keeps one per
    block, N > 0 one per N-token segment. ``max_num_batched_tokens`` must be the driver's (the split reads it).
    """

    name = "vllm-hybrid"

    def __init__(
        self,
        num_pages: int,
        page_size: int | None = None,
        max_model_len: int = 65536,
        hash_name: str = "sha256",
        shape: HybridShape = QWEN35,
        gdn_prefill_backend: str = "triton",
        retention_interval: int | None = 0,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        v = self._v = _vllm()
        self._h = _load()
        plan = self.plan = _plan(shape, gdn_prefill_backend, max_model_len, max_num_batched_tokens,
                                 retention_interval, hash_name)  # fmt: skip
        if page_size is not None and page_size != plan.block_size:
            raise ValueError(f"vLLM sets this model's block size to {plan.block_size} tokens, not {page_size}")
        self.num_pages, self.page_size, self.hash_name = num_pages, plan.block_size, hash_name
        self.kv_cache_config = v.kv_cache_planning.get_kv_cache_config_from_groups(
            plan.vllm_config, plan.groups, (num_pages + 1) * plan.bytes_per_block
        )
        scheduler_block_size, hash_block_size = self._h.resolve_kv_cache_block_sizes(
            self.kv_cache_config, plan.vllm_config
        )
        self.hash_block_size = hash_block_size
        self._hasher = _block_hasher(v, hash_block_size, hash_name)
        self.manager: Any = v.KVCacheManager(
            self.kv_cache_config,
            max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            enable_caching=True,
            log_stats=True,
        )
        self._pool = self.manager.block_pool
        self._status = v.RequestStatus
        self._sampling: dict[int, Any] = {}
        self._split_self = _split_context(
            self._h, self.manager, plan.vllm_config, scheduler_block_size, hash_block_size
        )

    @classmethod
    def bytes_per_block(cls, shape: HybridShape = QWEN35, gdn_prefill_backend: str = "triton") -> int:
        """Bytes of one vLLM block across all layers (`_pool_bytes_per_block`: unified page x layers per group)."""
        return _plan(shape, gdn_prefill_backend, 65536, 8192, 0, "sha256").bytes_per_block

    @classmethod
    def blocks_for_bytes(
        cls, budget_bytes: int, shape: HybridShape = QWEN35, gdn_prefill_backend: str = "triton"
    ) -> int:
        """vLLM's ``KVCacheConfig.num_blocks`` for a KV budget: bytes // bytes per block (null block included)."""
        return budget_bytes // cls.bytes_per_block(shape, gdn_prefill_backend)

    @classmethod
    def from_bytes(cls, budget_bytes: int, **kwargs: Any) -> VllmHybridAdapter:
        """The adapter vLLM would build from `budget_bytes` of KV memory (num_pages = its blocks - null block)."""
        shape = kwargs.get("shape", QWEN35)
        backend = kwargs.get("gdn_prefill_backend", "triton")
        return cls(cls.blocks_for_bytes(budget_bytes, shape, backend) - 1, **kwargs)

    def _request(self, req: TraceRequest) -> Any:
        sp = self._sampling.get(req.output_len)
        if sp is None:
            sp = self._sampling[req.output_len] = self._v.SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        prompt = req.tokens[: req.prompt_len].tolist()
        return self._v.Request(str(req.rid), prompt, sp, None, arrival_time=0.0, block_hasher=self._hasher)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        r = req.handle
        if r is None:
            r = req.handle = self._request(req)
        blocks, hit, r.shared_prefix_boundary = self.manager.get_computed_blocks(r)
        n = min(r.num_tokens - hit, budget)
        n = self._h.split(self._split_self, r, n, hit, 0)
        if n == 0 or self.manager.allocate_slots(r, n, hit, blocks) is None:
            return None
        self.manager.record_prefix_cache_stats(r, hit)
        r.status = self._status.RUNNING
        r.num_computed_tokens = hit
        return hit, n

    def clip_chunk(self, req: TraceRequest, n: int) -> int:
        return int(self._h.split(self._split_self, req.handle, n))

    def extend(self, req: TraceRequest, n: int) -> bool:
        return self.manager.allocate_slots(req.handle, n) is not None

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        for req, n in batch:
            r = req.handle
            r.num_computed_tokens += n
            while r.num_tokens < req.num_tokens:  # the driver sampled a token
                r.append_output_token_ids(req.tokens.item(r.num_tokens))
        mgr = self.manager
        mgr.take_boundary_state_offloads()  # no connector takes them (scheduler.py:1678-1681)
        _, retained = mgr.take_kv_cache_block_copies()  # no worker copies (scheduler.py:1698-1700)
        if retained:
            self._pool.free_blocks(retained)  # the step is over: _free_cow_retained_blocks frees them now
        mgr.take_new_block_ids()  # drained every step (scheduler.py:1790-1797)

    def free(self, req: TraceRequest, preempted: bool) -> None:
        r = req.handle
        self.manager.free(r)
        if preempted:
            r.status = self._status.PREEMPTED
            r.num_computed_tokens = 0
            r.num_preemptions += 1
        else:
            r.status = self._status.FINISHED_LENGTH_CAPPED
            req.handle = None

    def used_pages(self) -> int:
        return int(self._pool.num_gpu_blocks - 1 - self._pool.get_num_free_blocks())

    def prefix_cache_stats(self) -> tuple[int, int, int, int]:
        """vLLM's own counters since construction: (queries, hits) of first admissions, then of re-admissions."""
        s = self.manager.prefix_cache_stats
        return int(s.queries), int(s.hits), int(s.preempted_queries), int(s.preempted_hits)


def _split_context(
    h: SimpleNamespace, manager: Any, vllm_config: SimpleNamespace, block_size: int, hash_block_size: int
) -> SimpleNamespace:
    """The `Scheduler` attributes `_mamba_block_aligned_split` reads, derived as `Scheduler.__init__` derives them.

    ``scheduler.py``: block_size = the scheduler block size (:218), hash_block_size (:348-350),
    max_num_scheduled_tokens (:139-143), no EAGLE block drop and no hash lookahead (:296, :342-345), then
    :432-466 for the Mamba fields. ``cache_config`` and ``scheduler_config`` are the real config objects.
    """
    groups = manager.kv_cache_config.kv_cache_groups
    mamba_specs = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, h.MambaSpec)]
    cache_config, scheduler_config = vllm_config.cache_config, vllm_config.scheduler_config
    has_mamba = manager.kv_cache_config.has_mamba_layers
    need_split = has_mamba and cache_config.mamba_cache_mode == "align"
    partial = need_split and hash_block_size < block_size and manager.coordinator.enable_partial_hash_hits
    sched_tokens = scheduler_config.max_num_scheduled_tokens
    return SimpleNamespace(
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        block_size=block_size,
        hash_block_size=hash_block_size,
        max_num_scheduled_tokens=sched_tokens if sched_tokens is not None else scheduler_config.max_num_batched_tokens,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        mamba_prefill_checkpoint_alignment=next((s.prefill_checkpoint_alignment for s in mamba_specs), None),
        mamba_has_prefill_checkpoint_blocks=has_mamba and all(s.num_prefill_checkpoint_blocks > 0 for s in mamba_specs),
        mamba_partial_cache_hit=partial,
        mamba_shared_prefix_checkpoint=partial and manager.mamba_shared_prefix_checkpoint,
    )
