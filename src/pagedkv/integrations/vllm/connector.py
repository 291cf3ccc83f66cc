"""`PagedKVConnector`: a vLLM v1 KV connector (`KVConnectorBase_V1`) over pagedkv's disk and Redis tiers.

Imports vLLM: load it through `pagedkv.integrations.vllm` (whose module
``__getattr__`` imports this module on first use), as vLLM's
``KVConnectorFactory`` does with ``kv_connector_module_path``.

Scheduler side (the engine core process):

- `get_num_new_matched_tokens`: the request's full blocks beyond the local hit, keyed by vLLM's
  ``request.block_hashes``, that every TP rank's tier holds (pipelined EXISTS / one stat per page);
  never the last token (it must be computed). Side-effect free.
- `update_state_after_alloc`: remembers the blocks vLLM allocated for a load.
- `build_connector_meta`: per step, the loads (blocks, keys) and the saves: every block that this
  step fills (its tokens' KV is computed by this step's forward) and whose hash is known.
- `request_finished`: delays the free of a request's blocks while an async load still writes them.

Worker side (each worker process; every call on the model runner's thread):

- `register_kv_caches`: vLLM's per-layer ``[B, H, N, C]`` views -> `BlockMover`.
- `start_load_kv`: sync loads run now (before the forward, vLLM calls it first when
  ``has_sync_kv_loads``); async loads go to a loader thread, reported by `get_finished`.
- `wait_for_save`: copies this step's filled blocks to staging rows (synchronously, so vLLM may reuse
  the blocks after the step), the tiers write them in the background.
- `get_block_ids_with_load_errors`: blocks whose page was missing, refused (forged, truncated, other
  layout) or unreachable, so vLLM recomputes them (``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pagedkv.integrations.vllm.blocks import BlockMover
from pagedkv.integrations.vllm.layout import BlockLayout
from pagedkv.integrations.vllm.settings import ConnectorSettings, parse_extra_config
from pagedkv.integrations.vllm.tiers import TierSet

__all__ = ["LoadJob", "PagedKVConnector", "PagedKVConnectorMetadata", "SaveJob", "block_layout"]

log = logging.getLogger("pagedkv.integrations.vllm")


@dataclass
class LoadJob:
    """Load pages `keys` into blocks `block_ids` of request `req_id` (between steps when `is_async`)."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]
    is_async: bool = False


@dataclass
class SaveJob:
    """Store blocks `block_ids` (filled by this step) under `keys`."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class PagedKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's transfers, scheduler -> workers (picklable: lists of ints and bytes)."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


def block_layout(vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> BlockLayout:
    """The `BlockLayout` of this engine's single KV-cache group; ValueError for what the connector
    does not serve (several groups, non-attention specs, pipeline parallelism)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"PagedKVConnector serves models with one KV cache group, this one has {len(groups)} "
                         "(run with --disable-hybrid-kv-cache-manager, or without the connector)")  # fmt: skip
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or not spec.has_layer_views:
        raise ValueError(f"PagedKVConnector stores full-attention (or MLA) blocks, not {type(spec).__name__}")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"PagedKVConnector does not support pipeline_parallel_size="
                         f"{parallel.pipeline_parallel_size} (tensor parallelism is supported)")  # fmt: skip
    _, heads, tokens, head_bytes = compute_layer_kv_cache_shape_bytes(spec, 1)
    cache = vllm_config.cache_config
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or cache.hash_block_size or spec.block_size
    return BlockLayout(
        model_id=settings.model_id or str(vllm_config.model_config.model), layer_names=tuple(groups[0].layer_names),
        spec_kind=type(spec).__name__, dtype=str(spec.dtype), cache_dtype=str(cache.cache_dtype),
        block_size=tokens, hash_block_size=hash_block, num_heads=heads, head_bytes=head_bytes,
        head_size=spec.head_size, head_size_v=spec.head_size_v, tp_size=parallel.tensor_parallel_size,
        hash_algo=str(cache.prefix_caching_hash_algo),
    )  # fmt: skip


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside an initialized model-parallel group)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    return 0


class PagedKVConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM v1 KV connector whose storage is pagedkv's disk and / or Redis tier (see the module doc).

    Built by vLLM's ``KVConnectorFactory`` as ``PagedKVConnector(vllm_config, role, kv_cache_config)``,
    once per role; raises ValueError / TypeError for a bad ``kv_connector_extra_config`` (naming the
    key) or an unsupported KV cache layout, before any tier is contacted."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = parse_extra_config(transfer.kv_connector_extra_config)
        self.layout = block_layout(vllm_config, kv_cache_config, self.settings)
        self.block_size = self.layout.block_size
        self.saves_enabled = bool(transfer.is_kv_producer)
        self.loads_enabled = bool(transfer.is_kv_consumer)
        if self.layout.hash_algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
            log.warning("prefix_caching_hash_algo=%s seeds its hash chain randomly per process unless "
                        "PYTHONHASHSEED is set: other engines will not find this one's pages",
                        self.layout.hash_algo)  # fmt: skip
        if role == KVConnectorRole.SCHEDULER:
            self.tp_rank = -1
            self.lookup = [self._tierset(r) for r in range(self.layout.tp_size)]  # every rank's pages
            self._requests: dict[str, Any] = {}  # req_id -> vLLM Request
            self._pending_loads: dict[str, tuple[list[int], int, bool]] = {}  # req_id -> (blocks, tokens, async)
            self._async_inflight: set[str] = set()
        else:
            self.tp_rank = _tp_rank()
            self.tiers = self._tierset(self.tp_rank)
            self.mover: BlockMover | None = None
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-vllm-load")
            self._async_loads: dict[str, tuple[LoadJob, Future[int]]] = {}
            self._failed_blocks: set[int] = set()

    def _tierset(self, tp_rank: int) -> TierSet:
        return TierSet(self.settings.tiers, self.layout.row_bytes, self.layout.fingerprint(tp_rank),
                       self.layout.format_hash_algo, max_pending_bytes=self.settings.max_pending_save_bytes,
                       pin_memory=torch.cuda.is_available())  # fmt: skip

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """None: any `KVCacheLayout` works (blocks are copied through vLLM's logical views)."""
        return None

    # ================================================================= scheduler side
    def _keys(self, request: Any) -> list[bytes]:
        return self.layout.block_keys(request.block_hashes)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` (block aligned) whose blocks every rank's tier holds, and
        whether they load asynchronously; ``(0, False)`` when none. Reads the tiers only."""
        if not self.loads_enabled:
            return 0, False
        keys = self._keys(request)
        start = num_computed_tokens // self.block_size
        stop = min((request.num_tokens - 1) // self.block_size, len(keys))  # the last token is computed
        if stop <= start:
            return 0, False
        hits = min(tiers.leading_hits(keys[start:stop]) for tiers in self.lookup)
        if hits == 0:
            return 0, False
        return hits * self.block_size, self.settings.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request and, when it loads, its blocks (the load plan is made per step)."""
        self._requests[request.request_id] = request
        if num_external_tokens > 0:
            (block_ids,) = blocks.get_block_ids()
            self._pending_loads[request.request_id] = (list(block_ids), num_external_tokens,
                                                       self.settings.load_async)  # fmt: skip

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> PagedKVConnectorMetadata:
        """This step's loads (allocated since the last call) and saves (blocks this step fills)."""
        meta = PagedKVConnectorMetadata()
        bs = self.block_size
        for req_id, (block_ids, tokens, is_async) in self._pending_loads.items():
            request = self._requests[req_id]
            end = request.num_computed_tokens // bs  # the local hit plus the loaded tokens
            start = end - tokens // bs
            meta.loads.append(LoadJob(req_id, block_ids[start:end], self._keys(request)[start:end], is_async))
            if is_async:
                self._async_inflight.add(req_id)
        self._pending_loads.clear()
        if not self.saves_enabled:
            return meta
        state = scheduler_output.kv_connector_block_state
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or not scheduled:
                continue
            keys = self._keys(request)
            first = request.num_computed_tokens // bs  # computed before this step (loads included)
            last = min((request.num_computed_tokens + scheduled) // bs, len(keys))
            if last <= first:
                continue
            groups = state.get_block_ids(req_id) if state is not None else None
            if groups is None:
                groups = self._kv_cache_manager.get_block_ids(req_id)
            meta.saves.append(SaveJob(req_id, list(groups[0][first:last]), keys[first:last]))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._async_inflight.difference_update(connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; keep its blocks (True) while an async load may still write into them:
        the worker's ``finished_recving`` for it frees them."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        return req_id in self._async_inflight, None

    # ================================================================= worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer views (``[B, H, N, C]`` each, one shared buffer); ValueError when they
        do not match the layout the pages are fingerprinted with."""
        mover = BlockMover(kv_caches, self.layout.layer_names)
        expected = (self.layout.num_layers, self.layout.num_heads, self.block_size, self.layout.head_bytes)
        if mover.block_shape != expected:
            raise ValueError(f"registered KV views hold blocks of [L, H, N, C bytes] = {mover.block_shape}, the "
                             f"KV cache config says {expected}")  # fmt: skip
        self.mover = mover

    def _mover(self) -> BlockMover:
        if self.mover is None:
            raise RuntimeError("PagedKVConnector: register_kv_caches was not called")
        return self.mover

    def _load(self, job: LoadJob) -> int:
        return self.tiers.load(job.keys, job.block_ids, self._mover())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Run this step's sync loads now (failures -> `get_block_ids_with_load_errors`); start the
        async ones on the loader thread."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PagedKVConnectorMetadata)
        for job in meta.loads:
            if job.is_async:
                self._async_loads[job.req_id] = (job, self._loader.submit(self._load, job))
                continue
            got = self._load(job)
            self._failed_blocks.update(job.block_ids[got:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: a sync load has filled every layer before the forward starts."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """No-op: `wait_for_save` copies every layer's filled blocks at once (one gather)."""

    def wait_for_save(self) -> None:
        """Copy the blocks this step filled to staging rows, then let the tiers write them (background)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, PagedKVConnectorMetadata)
        if not meta.saves:
            return
        keys = [k for job in meta.saves for k in job.keys]
        block_ids = [b for job in meta.saves for b in job.block_ids]
        self.tiers.save(keys, block_ids, self._mover())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Async loads that completed since the last call (``finished_recving``); their failed blocks go
        to `get_block_ids_with_load_errors` in the same pass."""
        done = {req_id for req_id, (_, future) in self._async_loads.items() if future.done()}
        for req_id in done:
            job, future = self._async_loads.pop(req_id)
            try:
                got = future.result()
            except Exception:  # noqa: BLE001 - a failed copy is a failed load: vLLM recomputes it
                log.exception("PagedKVConnector: async load of %s failed", req_id)
                got = 0
            self._failed_blocks.update(job.block_ids[got:])
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes from the first of them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_writes(self) -> None:
        """Block until every page saved so far is written (tests, benchmarks, shutdown)."""
        if self._role == KVConnectorRole.WORKER:
            self.tiers.wait()

    def shutdown(self) -> None:
        """Finish loads and writes; release threads and connections."""
        if self._role == KVConnectorRole.WORKER:
            self._loader.shutdown(wait=True)
            self.tiers.shutdown()
        else:
            for tiers in self.lookup:
                tiers.shutdown()
