"""Memory planning: byte budgets to page counts, per data-parallel replica.

    pages per replica = min((budget // dp) // bytes_per_block,
                            ceil(max_seq_len / page_size) * max_batch_size)

`bytes_per_block` covers one page over a replica's whole TP group (FP8
scales included; MLA counts every replicated copy), so the budget is the sum
over all devices. A hybrid tree's attention groups alias one arena row per
page id (`pool_page_bytes`: the largest group's page, not the sum). Recurrent
state lives in rows of its own (`state_row_bytes`: every state group's page,
side by side), one set per running request (`num_state_rows`); a budget pays
for those rows first. State checkpoints of a model with attention pages take
runs of `checkpoint_pages` attention pages (one budget with the pages); a model
of state layers only keeps them in more state rows (`max_state_checkpoints`).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.groups import FullAttentionManager, MLAAttentionManager, manager_for
from pagedkv.params.kv import KVCacheParams, KVConnectorType
from pagedkv.params.multi import KVCacheParamInterface, MultiKVCacheParams
from pagedkv.params.validation import check_int

__all__ = [
    "ROW_ALIGN",
    "pool_page_bytes",
    "is_hybrid",
    "state_slots_per_request",
    "state_row_bytes",
    "num_state_rows",
    "checkpoint_pages",
    "run_checkpoint_cap",
    "default_state_checkpoints",
    "with_budget_checkpoints",
    "compute_num_device_blocks",
    "compute_num_host_blocks",
    "estimated_memory_size",
    "compute_max_seq_len_fitting_in_cache",
    "infer_optimal_batch_size",
]

logger = logging.getLogger(__name__)
GiB = 1024**3


ROW_ALIGN = 8  # bytes: a hybrid arena row is a multiple of this, so every dtype view of a row starts aligned


def is_hybrid(params: KVCacheParamInterface) -> bool:
    """True when some cache keeps fewer than all tokens, is cross-attention or holds recurrent state (its
    spec's manager is not plain full attention): its groups then alias one arena row per page id."""
    return any(type(manager_for(0, leaf.kv_cache_spec)) not in _FULL for leaf in params.leaves())


_FULL = (FullAttentionManager, MLAAttentionManager)


def _is_state(leaf: object) -> bool:
    return hasattr(getattr(leaf, "kv_cache_spec", None), "slots_per_request")


def pool_page_bytes(params: KVCacheParamInterface) -> int:
    """Bytes one attention page id costs on a replica (all its TP shards): `bytes_per_block`, or for a
    hybrid tree of several caches the arena row, the largest attention cache's page per device rounded
    up to `ROW_ALIGN`, times the TP degree (0 for a tree of state caches only)."""
    leaves = params.leaves()
    if len(leaves) == 1 and not _is_state(leaves[0]) or not is_hybrid(params):
        return params.bytes_per_block
    tokens = [leaf.bytes_per_block_per_device for leaf in leaves if not _is_state(leaf)]
    row = max(tokens, default=0)
    return -(-row // ROW_ALIGN) * ROW_ALIGN * params.tensor_parallel_degree


def state_slots_per_request(params: KVCacheParamInterface) -> int:
    """State rows a running request holds (its live and draft state slots), whatever its length."""
    return max((int(getattr(leaf.kv_cache_spec, "slots_per_request", 0)) for leaf in params.leaves()), default=0)


def state_row_bytes(params: KVCacheParamInterface) -> int:
    """Bytes of one state row on a replica (all TP shards): every state cache's page per device, each
    rounded up to `ROW_ALIGN`, side by side (0 without state caches)."""
    per_device = sum(-(-leaf.bytes_per_block_per_device // ROW_ALIGN) * ROW_ALIGN
                     for leaf in params.leaves() if _is_state(leaf))  # fmt: skip
    return per_device * params.tensor_parallel_degree


def checkpoint_pages(params: KVCacheParamInterface) -> int:
    """Attention pages one state checkpoint's run takes (the state row's bytes over the pool page's, rounded
    up), or 0: no recurrent state, prefix caching off, or no attention pages (checkpoints then take rows)."""
    row, page = state_row_bytes(params), pool_page_bytes(params)
    if not row or not page or not params.enable_prefix_caching:
        return 0
    return -(-row // page)


RUNS_PER_SLOT = 2  # checkpoints in runs kept when no cap is set, per batch slot


def run_checkpoint_cap(params: KVCacheParamInterface, max_batch_size: int) -> int:
    """How many checkpoints in runs of attention pages a replica keeps: `max_state_checkpoints`, or two per
    batch slot when it is None (a running request's two most recent; they take no memory of their own, the
    cap only stops unshared checkpoints from crowding out the pages that hits need)."""
    cap = params.max_state_checkpoints
    return RUNS_PER_SLOT * max_batch_size if cap is None else cap


CHECKPOINT_SHARE = 3  # with a byte budget and no cap set, checkpoints take a third of what live rows leave


def default_state_checkpoints(max_batch_size: int, budget: int | None = None, row_bytes: int = 0) -> int:
    """State checkpoints kept when `max_state_checkpoints` is None. With a replica's byte `budget`: a third
    of what the live rows of `max_batch_size` requests leave of it, in rows of `row_bytes` (at least one;
    the other two thirds buy attention pages). With no budget (a page count was given): two per batch
    slot."""
    if budget is not None and row_bytes:
        return max(1, (budget - max_batch_size * row_bytes) // (CHECKPOINT_SHARE * row_bytes))
    return 2 * max_batch_size


def with_budget_checkpoints(params: KVCacheParamInterface, budget: int, max_batch_size: int) -> KVCacheParamInterface:
    """`params` with `max_state_checkpoints` set from a replica's byte `budget` (`default_state_checkpoints`)
    when a model of state layers only, with prefix caching, leaves it None (every cache of a flat tree shares
    the field); else `params` itself (checkpoints in runs of attention pages need no share of the budget)."""
    if not state_slots_per_request(params) or not params.enable_prefix_caching or checkpoint_pages(params):
        return params
    if params.max_state_checkpoints is not None:
        return params
    return _with_cap(params, default_state_checkpoints(max_batch_size, budget, state_row_bytes(params)))


def _with_cap(params: KVCacheParamInterface, cap: int) -> KVCacheParams | MultiKVCacheParams:
    if isinstance(params, MultiKVCacheParams):
        return MultiKVCacheParams({name: _with_cap(child, cap) for name, child in params.children.items()})
    assert isinstance(params, KVCacheParams)
    return dataclasses.replace(params, max_state_checkpoints=cap)


def num_state_rows(params: KVCacheParamInterface, max_batch_size: int, budget: int | None = None) -> int:
    """State rows per replica: `max_batch_size` requests' live and draft slots, plus, for a model of state
    layers only, the checkpoints (`max_state_checkpoints`, or `default_state_checkpoints` of a replica's
    `budget`) when prefix caching is on (0 without state caches)."""
    slots = state_slots_per_request(params)
    if not slots:
        return 0
    if checkpoint_pages(params):  # (checkpoints take runs of attention pages)
        return max_batch_size * slots
    cap = getattr(params, "max_state_checkpoints", None)
    checkpoints = default_state_checkpoints(max_batch_size, budget, state_row_bytes(params)) if cap is None else cap
    return max_batch_size * slots + (checkpoints if params.enable_prefix_caching else 0)


def compute_num_device_blocks(
    params: KVCacheParamInterface,
    available_cache_memory: int,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
) -> int:
    """Pages per replica that fit in `available_cache_memory` bytes (all devices together).

    When both `max_batch_size` and `max_seq_len` are given, never more than
    that many full-length sequences need. Raises `InsufficientBlocksError`
    when not even one page fits.
    """
    check_int("available_cache_memory", available_cache_memory, 0)
    dp, per_page = params.data_parallel_degree, pool_page_bytes(params)
    rows = num_state_rows(params, max_batch_size or 1, available_cache_memory // dp)
    state_bytes = rows * state_row_bytes(params)
    if state_bytes and state_bytes > available_cache_memory // dp:
        raise InsufficientBlocksError(
            f"available_cache_memory={available_cache_memory} bytes over {dp} replica(s) cannot hold the "
            f"{rows} state rows of {state_row_bytes(params)} bytes (live slots of max_batch_size={max_batch_size} "
            "requests + max_state_checkpoints); lower them or raise the budget",
            needed=rows,
            available=(available_cache_memory // dp) // state_row_bytes(params),
        )
    if per_page == 0:  # state caches only: the attention pool is a placeholder
        return 1
    allocable = (available_cache_memory // dp - state_bytes) // per_page
    if allocable == 0:
        raise InsufficientBlocksError(
            f"Insufficient cache memory to allocate even a single page: {available_cache_memory} bytes over "
            f"{dp} replica(s), {per_page} bytes per page",
            needed=1,
            available=0,
        )
    blocks = allocable
    if max_batch_size is not None and max_seq_len is not None:
        check_int("max_batch_size", max_batch_size, 1)
        check_int("max_seq_len", max_seq_len, 1)
        pages_per_seq = math.ceil(max_seq_len / params.page_size)
        blocks = min(allocable, pages_per_seq * max_batch_size)
        if pages_per_seq > allocable:
            logger.warning(
                "one sequence of max_seq_len=%d needs %d pages; only %d fit", max_seq_len, pages_per_seq, allocable
            )
        elif max_batch_size > allocable:
            logger.warning("max_batch_size=%d exceeds the %d pages that fit", max_batch_size, allocable)
    return blocks


def estimated_memory_size(
    params: KVCacheParamInterface,
    available_cache_memory: int,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
) -> int:
    """Bytes the device pages and state rows take over all replicas (never more than available or needed)."""
    blocks = compute_num_device_blocks(params, available_cache_memory, max_batch_size, max_seq_len)
    rows = num_state_rows(params, max_batch_size or 1, available_cache_memory // params.data_parallel_degree)
    rows *= state_row_bytes(params)
    return (blocks * pool_page_bytes(params) + rows) * params.data_parallel_degree


def compute_max_seq_len_fitting_in_cache(params: KVCacheParamInterface, available_cache_memory: int) -> int:
    """Longest single sequence the budget holds: pages per replica times page size."""
    return compute_num_device_blocks(params, available_cache_memory) * params.page_size


def infer_optimal_batch_size(params: KVCacheParamInterface, max_seq_len: int, available_cache_memory: int) -> int:
    """Largest batch whose sequences can all reach `max_seq_len` without preemption (at least 1)."""
    check_int("max_seq_len", max_seq_len, 1)
    pages = compute_num_device_blocks(params, available_cache_memory)
    return max(1, pages // math.ceil(max_seq_len / params.page_size))


def host_bytes_per_block(params: KVCacheParamInterface) -> int:
    """Bytes of one page in host memory: replicated (MLA) caches keep a single copy; a hybrid tree's page
    is its arena row (`pool_page_bytes`: the largest attention cache's page, state caches excluded)."""
    if is_hybrid(params):
        return pool_page_bytes(params)
    return sum(
        leaf.bytes_per_block // leaf.tensor_parallel_degree if leaf.replicates_kv_across_tp else leaf.bytes_per_block
        for leaf in params.leaves()
    )


def compute_num_host_blocks(params: KVCacheParamInterface, any_connector: bool = False) -> int:
    """Host pages per replica for `host_kvcache_swap_space_gb` (0 without a local/tiered connector;
    with `any_connector`, also for a redis connector when the swap space is set)."""
    kinds = (KVConnectorType.local, KVConnectorType.tiered, KVConnectorType.redis)[: 3 if any_connector else 2]
    if params.kv_connector not in kinds or params.host_kvcache_swap_space_gb is None:
        return 0
    swap = params.host_kvcache_swap_space_gb
    assert swap is not None  # guaranteed by KVCacheParams validation
    blocks = int(swap * GiB // host_bytes_per_block(params))
    if blocks == 0:
        raise InsufficientBlocksError(
            f"host_kvcache_swap_space_gb={swap} holds no page of {host_bytes_per_block(params)} bytes",
            needed=1,
            available=0,
        )
    return blocks
