"""How `PagedKVCacheManager` serves hybrid models (caches that are not all full attention).

A model is hybrid when a cache keeps only some tokens (sliding window,
chunked local, sinks), is cross-attention or holds recurrent state. Then
every cache (a child of a flat `MultiKVCacheParams`, or the single
`KVCacheParams`) is a group with its own page table, the attention groups
draw page ids from one pool (`KVCacheCoordinator`) and their buffers alias
one arena per device; state groups share rows of a state pool and arena
(live slots and checkpoints, `core.state.checkpoints`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core import memory
from pagedkv.core.block_manager import BlockManager
from pagedkv.core.coordinator import KVCacheCoordinator
from pagedkv.core.groups import manager_for
from pagedkv.core.memory import is_hybrid
from pagedkv.core.replica import ReplicaBookkeeping
from pagedkv.core.tables import BatchTables
from pagedkv.params.kv import KVCacheParams
from pagedkv.params.multi import KVCacheParamInterface, MultiKVCacheParams
from pagedkv.params.state import StateCacheParams
from pagedkv.runtime.arena import allocate_arena_buffers
from pagedkv.runtime.inputs import KVCacheInputs, MultiKVCacheInputs, RaggedKVCacheInputs, StateCacheInputs
from pagedkv.runtime.state_buffers import StateCacheBuffer
from pagedkv.runtime.transfer import tables_to_device

__all__ = [
    "commits_on_alloc",
    "is_hybrid",
    "group_names",
    "make_block_manager",
    "allocate_buffers",
    "hybrid_inputs",
]


def group_names(params: KVCacheParamInterface) -> list[str]:
    """Group names in group order: the children of a flat tree, or ``["cache"]``."""
    if not isinstance(params, MultiKVCacheParams):
        return ["cache"]
    if any(isinstance(c, MultiKVCacheParams) for c in params.children.values()):
        raise ValueError("a hybrid MultiKVCacheParams must be flat: one KVCacheParams child per group")
    return list(params.children)


def commits_on_alloc(params: KVCacheParamInterface) -> bool:
    """Whether pages become hittable at `alloc` (schedule-time caching): `commit_on_alloc` when set, else on
    with prefix caching for a model of one KV cache group without partial-page reuse (off by default for a
    model of several groups; True turns it on for one without recurrent state, see docs/CACHE.md)."""
    if params.commit_on_alloc is None:
        return not is_hybrid(params) and params.enable_prefix_caching and not params.enable_partial_page_reuse
    return bool(params.commit_on_alloc)


def make_block_manager(
    params: KVCacheParamInterface, total_num_pages: int, max_batch_size: int = 1
) -> ReplicaBookkeeping:
    """A `BlockManager` (all full attention) or a `KVCacheCoordinator` with one group per cache (state
    caches get `memory.num_state_rows(params, max_batch_size)` state rows; their checkpoints take runs of
    `memory.checkpoint_pages(params)` attention pages, at most `memory.run_checkpoint_cap`).

    ValueError for ``enable_partial_page_reuse`` or ``commit_on_alloc`` on a model with recurrent state (the
    coordinator does not support them)."""
    kwargs: dict[str, Any] = dict(
        enable_prefix_caching=params.enable_prefix_caching, hash_algo=params.kv_hash_algo,
        hash_seed=params.kv_hash_seed, num_speculative_tokens=params.num_eagle_speculative_tokens,
        eviction_policy=params.eviction_policy, protected_fraction=params.protected_fraction,
        evict_leaves_first=params.evict_leaves_first,
    )  # fmt: skip
    if not is_hybrid(params):
        bm = BlockManager(total_num_pages, params.page_size, partial_page_reuse=params.enable_partial_page_reuse,
                          commit_on_alloc=commits_on_alloc(params),
                          commit_unscheduled=params.commit_on_alloc is True, **kwargs)  # fmt: skip
        bm.hasher.set_version(params.weights_version)
        return bm
    group_names(params)  # validates the shape of the tree
    groups = [manager_for(g, leaf.kv_cache_spec) for g, leaf in enumerate(params.leaves())]
    if params.enable_partial_page_reuse is True and any(g.state_slots for g in groups):
        raise ValueError("enable_partial_page_reuse=True does not support models with recurrent state (their hits "
                         "resume from a state checkpoint, which holds no partial page)")  # fmt: skip
    rows, run = memory.num_state_rows(params, max_batch_size), memory.checkpoint_pages(params)
    cap = memory.run_checkpoint_cap(params, max_batch_size) if run else None
    coordinator = KVCacheCoordinator(total_num_pages, params.page_size, groups, num_state_rows=rows,
                                     checkpoint_pages=run, max_state_checkpoints=cap,
                                     commit_on_alloc=commits_on_alloc(params),
                                     commit_unscheduled=params.commit_on_alloc is True,
                                     partial_page_reuse=params.enable_partial_page_reuse, **kwargs)  # fmt: skip
    coordinator.hasher.set_version(params.weights_version)
    return coordinator


def allocate_buffers(params: KVCacheParamInterface, total_num_pages: int, state_rows: int = 0) -> list[Any]:
    """Page buffers per replica: aliased arenas for a hybrid tree (and `state_rows` state rows, null row
    included), the params' own allocation otherwise."""
    if isinstance(params, MultiKVCacheParams) and is_hybrid(params):
        return allocate_arena_buffers(group_names(params), params.leaves(), total_num_pages, state_rows)

    return params.allocate_buffers(total_num_pages)


def hybrid_inputs(
    params: KVCacheParamInterface, buffers: list[Any], per_replica: list[list[BatchTables]]
) -> KVCacheInputs:
    """The runtime inputs tree: per group, one `RaggedKVCacheInputs` per device (replica-major).

    Decoder groups of a device share one `cache_lengths` tensor; each group has its own lookup table.
    """
    names, leaves = group_names(params), params.leaves()
    records: dict[str, list[RaggedKVCacheInputs | StateCacheInputs]] = {name: [] for name in names}
    for r, group_tables in enumerate(per_replica):
        for s, device in enumerate(leaves[0].devices_per_replica[r]):
            dev = device.to_torch()
            shared: torch.Tensor | None = None
            for name, leaf, tables in zip(names, leaves, group_tables, strict=True):
                lut, lengths, max_lengths = tables_to_device(tables, dev)
                if not leaf.is_cross_attention:
                    shared = lengths if shared is None else shared
                    lengths = shared
                buf = _leaf_buffer(buffers[r], name, isinstance(params, KVCacheParams))
                if isinstance(leaf, StateCacheParams):
                    assert isinstance(buf, StateCacheBuffer)
                    slots = lut[:, : leaf.spec.slots_per_request]  # [B, 1 + drafts]
                    state = StateCacheInputs(buf.values[s], lengths, slots, lengths > 0, buf.states[s])
                    records[name].append(state)  # type: ignore[arg-type]
                    continue
                scales = buf.scales[s] if buf.scales else None
                record = RaggedKVCacheInputs(buf.values[s], lengths, lut, max_lengths, scales)
                records[name].append(record.with_policy(leaf.nonfinite_kv))
    if isinstance(params, KVCacheParams):
        return KVCacheInputs(records["cache"])
    return MultiKVCacheInputs({name: KVCacheInputs(recs) for name, recs in records.items()})


def _leaf_buffer(buffer: Any, name: str, single: bool) -> Any:
    return buffer if single else buffer.children[name]
