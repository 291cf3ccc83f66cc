"""vLLM 0.33's real v1 `KVCacheManager` as a `CacheAdapter` (full attention, one KV-cache group).

Everything on the measured path is vLLM's own code: `Request` with vLLM's block hasher
(sha256 by default), `KVCacheManager.get_computed_blocks` / `allocate_slots` / `free`,
its coordinator and `BlockPool`. The calls follow vLLM's `Scheduler` convention as
described in vLLM's v1 scheduler and KV cache manager documentation. vLLM is imported lazily; without it
the constructor raises `PeerUnavailable`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.compare.peers import import_peer
from pagedkv.workloads.traces import TraceRequest

__all__ = ["VllmAdapter", "vllm_hash_ns_per_token", "vllm_version", "HASH_NAMES"]

HASH_NAMES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# The model shape only sizes the (never allocated) KV tensors; the manager reads block ids alone.
_LAYERS, _KV_HEADS, _HEAD_DIM = 32, 8, 128


def _vllm() -> SimpleNamespace:
    """vLLM's classes and functions used here (raises PeerUnavailable when vLLM is missing)."""

    def load() -> SimpleNamespace:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_planning
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
        from vllm.v1.request import Request, RequestStatus

        return SimpleNamespace(
            torch=torch,
            SamplingParams=SamplingParams,
            get_hash_fn_by_name=get_hash_fn_by_name,
            kv_cache_planning=kv_cache_planning,
            KVCacheManager=KVCacheManager,
            get_request_block_hasher=get_request_block_hasher,
            init_none_hash=init_none_hash,
            FullAttentionSpec=FullAttentionSpec,
            KVCacheConfig=KVCacheConfig,
            KVCacheGroupSpec=KVCacheGroupSpec,
            KVCacheTensor=KVCacheTensor,
            Request=Request,
            RequestStatus=RequestStatus,
        )

    return import_peer("vLLM", load)


def vllm_version() -> str:
    """The installed vLLM version (raises PeerUnavailable when vLLM is missing)."""
    return str(import_peer("vLLM", lambda: __import__("vllm").__version__))


def _block_hasher(v: SimpleNamespace, page_size: int, hash_name: str) -> Any:
    if hash_name not in HASH_NAMES:
        raise ValueError(f"hash_name must be one of {HASH_NAMES}, got {hash_name!r}")
    if hash_name.startswith("xxhash"):
        import_peer("xxhash (for vLLM's xxhash block hash)", lambda: __import__("xxhash"))
    fn = v.get_hash_fn_by_name(hash_name)
    v.init_none_hash(fn)  # vLLM's process-global seed of the hash chain, as EngineCore sets it
    return v.get_request_block_hasher(page_size, fn)


def _kv_cache_config(v: SimpleNamespace, num_blocks: int, page_size: int) -> Any:
    """One full-attention group over all layers, built by vLLM's own planner when it is there."""
    spec = v.FullAttentionSpec(
        block_size=page_size, num_kv_heads=_KV_HEADS, head_size=_HEAD_DIM, dtype=v.torch.bfloat16
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(_LAYERS)]
    specs = dict.fromkeys(names, spec)
    try:
        groups = v.kv_cache_planning._get_kv_cache_groups_uniform_spec(specs)
    except AttributeError:  # the private planner moved: the same single group by hand
        groups = [v.KVCacheGroupSpec(names, spec)]
    page = spec.page_size_bytes
    # Layer-outer layout; the manager never reads the tensors (vLLM's `KVCacheManager` hands out block ids only).
    tensors = [
        v.KVCacheTensor(
            size=page * num_blocks * _LAYERS, layers=names, layer_stride=page * num_blocks, block_stride=page
        )
    ]
    return v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


class VllmAdapter:
    """vLLM's `KVCacheManager` behind the `CacheAdapter` protocol.

    `num_pages` is the number of usable blocks; vLLM gets one more because block 0
    is its null block. Contracts per call:

    - admit: builds the vLLM `Request` at the first admission (its constructor hashes the
      prompt: bookkeeping, like pagedkv hashing inside its alloc), then
      ``get_computed_blocks`` + ``allocate_slots(req, n, hit, blocks)`` +
      ``record_prefix_cache_stats``. Returns (hit, n) with n = min(uncached, budget), or
      None with nothing allocated. A preempted request is re-admitted with its generated
      tokens (their blocks were hashed as they filled) and ``num_computed_tokens=0``.
    - extend: ``allocate_slots(req, n) is not None``.
    - advance: ``num_computed_tokens += n``; a token the driver appended goes in through
      ``append_output_token_ids`` (which hashes a block when it fills).
    - free: ``KVCacheManager.free``; when preempted, the request is reset as vLLM's
      scheduler does (status PREEMPTED, ``num_computed_tokens=0``).
    - used_pages: blocks with ref>0 (cached blocks in the free queue do not count).

    vLLM keeps the seed of its hash chain (``NONE_HASH``) process-global: each constructor
    re-seeds it for `hash_name`, so do not interleave adapters with different hash names.
    """

    name = "vllm"

    def __init__(
        self, num_pages: int, page_size: int = 16, max_model_len: int = 65536, hash_name: str = "sha256"
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        v = self._v = _vllm()
        self.num_pages, self.page_size, self.hash_name = num_pages, page_size, hash_name
        self._hasher = _block_hasher(v, page_size, hash_name)
        self.manager: Any = v.KVCacheManager(
            _kv_cache_config(v, num_pages + 1, page_size),
            max_model_len=max_model_len,
            scheduler_block_size=page_size,
            hash_block_size=page_size,
            enable_caching=True,
            log_stats=True,
        )
        self._pool = self.manager.block_pool
        self._status = v.RequestStatus
        self._sampling: dict[int, Any] = {}  # output_len -> SamplingParams

    def _request(self, req: TraceRequest) -> Any:
        """vLLM's `Request` for `req` (prompt hashed in its constructor)."""
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
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        n = min(r.num_tokens - hit, budget)
        if self.manager.allocate_slots(r, n, hit, blocks) is None:
            return None
        self.manager.record_prefix_cache_stats(r, hit)
        r.status = self._status.RUNNING
        r.num_computed_tokens = hit
        return hit, n

    def extend(self, req: TraceRequest, n: int) -> bool:
        return self.manager.allocate_slots(req.handle, n) is not None

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        for req, n in batch:
            r = req.handle
            r.num_computed_tokens += n
            while r.num_tokens < req.num_tokens:  # the driver sampled a token
                r.append_output_token_ids(req.tokens.item(r.num_tokens))

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


def vllm_hash_ns_per_token(prompts: list[np.ndarray], page_size: int = 16, hash_name: str = "sha256") -> float:
    """Nanoseconds per prompt token of vLLM's own block hasher, best of 3 passes.

    Each pass hashes every full `page_size` block of every prompt exactly as
    `Request.__init__` does (``block_hashes.extend(hasher(request))``), on requests
    built without a hasher so that only the hashing is timed.
    """
    v = _vllm()
    hasher = _block_hasher(v, page_size, hash_name)
    sp = v.SamplingParams(max_tokens=1, ignore_eos=True)
    reqs = [v.Request(str(i), p.tolist(), sp, None, arrival_time=0.0) for i, p in enumerate(prompts)]
    tokens = sum(len(p) for p in prompts)
    best = float("inf")
    for _ in range(3):
        for r in reqs:
            r.block_hashes = []
        t0 = time.perf_counter()
        for r in reqs:
            r.block_hashes.extend(hasher(r))
        best = min(best, time.perf_counter() - t0)
    return 1e9 * best / max(tokens, 1)
