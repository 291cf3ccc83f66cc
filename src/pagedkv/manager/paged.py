"""`PagedKVCacheManager`: paged KV cache over data- and tensor-parallel replicas (MAX's `PagedKVCacheManager`).

Each data-parallel replica has its own `BlockManager` (page ids, prefix cache)
and its own page buffers; a replica's TP shards share its page ids, lookup
table and cache lengths. Usage::

    mgr = PagedKVCacheManager(params, None, total_num_pages=64, max_batch_size=8)
    mgr.claim(ctx.request_id, replica_idx=0)
    mgr.alloc(ctx, replica_idx=0)                   # prefix hits + new pages
    inputs = mgr.runtime_inputs([[ctx]])            # tensors for the model
    ... model writes KV of ctx.tokens.active ...; ctx.update(token)
    mgr.step([[ctx]])                               # commit written pages
    mgr.release(ctx.request_id, replica_idx=0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pagedkv.core import memory
from pagedkv.core.context import RequestID, Retention, TextContext
from pagedkv.core.events import KVEventBatch
from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.core.replica import ReplicaBookkeeping
from pagedkv.core.state.checkpoints import RunCopy
from pagedkv.core.tables import BatchTables
from pagedkv.dtype import DeviceRef
from pagedkv.interface.config import KVCacheConfig
from pagedkv.manager import checks, hybrid
from pagedkv.manager.base import check_redundant_args
from pagedkv.manager.swap import SwappedRequests
from pagedkv.manager.tiering import Tiering
from pagedkv.ops.page_copy import copy_page_slots
from pagedkv.ops.state_runs import copy_state_run
from pagedkv.params.bridge import params_from_kv_cache_config
from pagedkv.params.kv import BatchCharacteristics, KVConnectorType
from pagedkv.params.multi import KVCacheParamInterface, MultiKVCacheParams
from pagedkv.params.validation import INT32_MAX, check_weights_version
from pagedkv.runtime.buffers import KVCacheBuffer, MultiKVCacheBuffer
from pagedkv.runtime.inputs import KVCacheInputs, MultiKVCacheInputs, RaggedKVCacheInputs
from pagedkv.runtime.state_buffers import StateCacheBuffer
from pagedkv.runtime.transfer import tables_to_device

__all__ = ["PagedKVCacheManager"]


class PagedKVCacheManager:
    """Paged KV cache with prefix caching, one page pool per data-parallel replica.

    Args:
        params: `KVCacheParams`, or `MultiKVCacheParams` for a model with several caches.
        session: MAX's `InferenceSession` slot, kept for signature compatibility and
            stored as `self.session`; pagedkv allocates with torch and never uses it. Pass None
            (or any object, e.g. a MAX session). An int is refused with TypeError: it is the
            older call ``PagedKVCacheManager(params, total_num_pages, ...)``.
        total_num_pages: device pages per replica (the null page comes on top).
        total_num_host_pages: host pages per replica; needs a host tier connector.
        enable_runtime_checks: run `check_integrity()` after every mutating call.
        max_batch_size: the largest batch `runtime_inputs` accepts per replica.

    A model with recurrent state gets `memory.num_state_rows` state rows per replica: the live rows of
    `max_batch_size` requests plus `max_state_checkpoints` (two per batch slot when that is None;
    `from_memory_budget` sets it from the budget).
    """

    def __init__(
        self,
        params: KVCacheParamInterface,
        session: Any,
        total_num_pages: int,
        total_num_host_pages: int = 0,
        enable_runtime_checks: bool = False,
        *,
        max_batch_size: int,
    ) -> None:
        checks.check_session(session)
        checks.check_manager(params, total_num_pages, total_num_host_pages, enable_runtime_checks, max_batch_size)
        if total_num_host_pages and params.kv_connector in (None, KVConnectorType.null):
            raise ValueError(f"total_num_host_pages={total_num_host_pages} needs a local, tiered or redis kv_connector")
        self.params = params
        self.session = session
        self.total_num_pages = total_num_pages
        self.total_num_host_pages = total_num_host_pages
        self.max_batch_size = max_batch_size
        self.enable_runtime_checks = bool(enable_runtime_checks)
        self.page_size = params.page_size
        self.num_replicas = params.data_parallel_degree
        self.hybrid = hybrid.is_hybrid(params)
        self.num_state_rows = memory.num_state_rows(params, max_batch_size)  # live (+ checkpoints: no attention)
        self._managers = [
            hybrid.make_block_manager(params, total_num_pages, max_batch_size) for _ in range(self.num_replicas)
        ]
        self._buffers = hybrid.allocate_buffers(params, total_num_pages + 1, self.num_state_rows + 1)
        self.tiers = Tiering(params, self._managers, self._buffers, total_num_host_pages)
        self.total_num_host_pages = self.tiers.host_pages
        self._swapped = SwappedRequests(self.tiers)

    @classmethod
    def from_memory_budget(
        cls,
        params: KVCacheParamInterface,
        available_cache_memory: int,
        *,
        max_batch_size: int,
        max_seq_len: int | None = None,
        enable_runtime_checks: bool = False,
    ) -> PagedKVCacheManager:
        """A manager with as many pages as `available_cache_memory` bytes hold (see `pagedkv.core.memory`). A
        model of state layers only, with prefix caching and `max_state_checkpoints` None, gets it set from the
        budget first (`memory.with_budget_checkpoints`; the manager's `params` show it)."""
        params = memory.with_budget_checkpoints(params, available_cache_memory // params.data_parallel_degree,
                                                max_batch_size)  # fmt: skip
        pages = memory.compute_num_device_blocks(params, available_cache_memory, max_batch_size, max_seq_len)
        return cls(params, None, pages, memory.compute_num_host_blocks(params), enable_runtime_checks,
                   max_batch_size=max_batch_size)  # fmt: skip

    @classmethod
    def from_kv_cache_config(
        cls,
        config: KVCacheConfig,
        devices: Sequence[DeviceRef],
        *,
        max_batch_size: int,
        enable_runtime_checks: bool = False,
        **params_kwargs: Any,
    ) -> PagedKVCacheManager:
        """A manager for vLLM's `KVCacheConfig` (e.g. from `get_kv_cache_config`): one group per
        `KVCacheGroupSpec`, `config.num_blocks` page ids shared by all. `params_kwargs` go to every
        group's `KVCacheParams` (``enable_prefix_caching=True``, ``eviction_policy="slru"``, ...)."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        params = params_from_kv_cache_config(config, devices, **params_kwargs)
        tree: KVCacheParamInterface = params.leaves()[0] if len(config.kv_cache_groups) == 1 else params
        return cls(tree, None, config.num_blocks, 0, enable_runtime_checks, max_batch_size=max_batch_size)

    # ----------------------------------------------------------------- request lifecycle
    def _bm(self, replica_idx: int) -> ReplicaBookkeeping:
        if type(replica_idx) is not int or not 0 <= replica_idx < self.num_replicas:
            raise ValueError(f"replica_idx={replica_idx!r} must be an int in [0, {self.num_replicas})")
        return self._managers[replica_idx]

    def _checked(self, bm: ReplicaBookkeeping) -> None:
        if self.enable_runtime_checks:
            bm.check_integrity()

    def claim(self, request_id: RequestID, replica_idx: int = 0) -> None:
        """Register `request_id` on a replica; no pages are taken yet."""
        bm = self._bm(replica_idx)
        checks.check_claim(self._swapped, request_id, replica_idx)
        bm.claim(request_id)
        self._checked(bm)

    def alloc_dummy(self, request_id: RequestID, replica_idx: int = 0) -> None:
        """Claim a padding request whose table is the null page only (takes no page)."""
        bm = self._bm(replica_idx)
        checks.check_claim(self._swapped, request_id, replica_idx)
        bm.claim(request_id, dummy=True)
        self._checked(bm)

    def contains(self, request_id: RequestID, replica_idx: int = 0) -> bool:
        """True while `request_id` is claimed on the replica."""
        return self._bm(replica_idx).contains(request_id)

    def alloc(self, data: TextContext, replica_idx: int = 0, *, num_scheduled_tokens: int | None = None) -> None:
        """Pages for every token of `data`, prefix-cache hits first (see `BlockManager.alloc`).

        `num_scheduled_tokens`: the tokens this step runs (chunk the context to at most that many); their
        full pages become hittable at once (schedule-time caching); windowed groups take pages for them.

        Raises `InsufficientBlocksError` when the pool is too full; nothing changes then.
        """
        valid = type(replica_idx) is int and 0 <= replica_idx < self.num_replicas  # (inlined `_bm`: the hot path)
        bm = self._managers[replica_idx] if valid else self._bm(replica_idx)
        n = num_scheduled_tokens  # (types and counts, before anything: a plain int in range passes at once)
        if type(data) is not TextContext or (n is not None and (type(n) is not int or not 0 < n <= INT32_MAX)):
            checks.check_alloc(data, n)
        if self.tiers.state_connectors:  # checkpoint images on their way down are read before alloc evicts them
            self.tiers.before_alloc()
        bm.alloc(data, num_scheduled_tokens)
        if self.enable_runtime_checks:
            bm.check_integrity()

    def step(self, batches: Sequence[Sequence[TextContext]]) -> None:
        """Commit the pages each request has written since the last step (one batch per replica)."""
        checks.check_step(self._managers, batches)  # every replica's batch, before any commit
        tiers = self.tiers if self.tiers.active else None  # (no tier, no listener: no tier call at all)
        if tiers is not None:
            tiers.before_step()
        for r, (bm, batch) in enumerate(zip(self._managers, batches, strict=True)):
            bm.step_batch(batch)
            if self.num_state_rows:
                self._apply_state_copies(r)  # checkpoints of this step's states, before the next forward moves them
            self._checked(bm)
        if tiers is not None:
            tiers.push_states()  # (down the tiers before the next alloc may evict them)
            tiers.after_step()

    def release(self, request_id: RequestID, replica_idx: int = 0) -> None:
        """Forget `request_id` and free its pages (tail first; cached pages stay hittable)."""
        bm = self._bm(replica_idx)
        checks.check_request_id(request_id)
        if not bm.contains(request_id) and self._swapped.drop(request_id, replica_idx):
            return
        if self.tiers.state_connectors:  # a tier copy staged for its state row lands before the release saves
            self.tiers.complete_loads()  # the row as a checkpoint; a checkpoint saved into a run may evict pages
            self.tiers.before_alloc()  # an image copy still reads (pages alone: the connector orders their copies)
        bm.release(request_id)
        if self.num_state_rows:
            self._apply_state_copies(replica_idx)  # a checkpoint saved at release copies before anyone moves on
        if self.tiers.state_connectors:
            self.tiers.push_states()
        self._checked(bm)

    @contextmanager
    def reserve(self, replica_batches: Sequence[Sequence[TextContext]]) -> Iterator[None]:
        """Claim and alloc every context for the scope; release them all on exit, even on error."""
        self._check_batches(replica_batches)
        taken: list[tuple[RequestID, int]] = []
        try:
            for r, batch in enumerate(replica_batches):
                for ctx in batch:
                    self.claim(ctx.request_id, r)
                    taken.append((ctx.request_id, r))
                    self.alloc(ctx, r)
            yield
        finally:
            for request_id, r in reversed(taken):
                self.release(request_id, r)

    def expect(self, contexts: Sequence[TextContext], replica_idx: int = 0) -> int:
        """Queue-aware retention (`BlockManager.expect`; `LLMEngine`'s scheduler calls it every step with its
        queue's head): what those waiting requests will hit is evicted last. Returns how many were new."""
        return self._bm(replica_idx).expect(contexts)

    def unexpect(self, request_id: RequestID, replica_idx: int = 0) -> None:
        """End what `expect` kept for a request that leaves the waiting queue without being admitted."""
        self._bm(replica_idx).wants.unexpect(request_id)

    def pin_prefix(self, tokens: Sequence[int], priority: int = 100, duration_s: float | None = None, *,
                   cache_salt: str | None = None, replica_idx: int = 0) -> int:  # fmt: skip
        """Give the cached pages of the page-aligned prefix of `tokens` retention `priority` (0..100; 35 is
        the default, so 35 unpins) for `duration_s` seconds (None: while cached), in every KV cache group.
        Returns the pages of the prefix found (for several groups: of the longest prefix each group resumes)."""
        return self._bm(replica_idx).pin_prefix(tokens, Retention(priority, duration_s), cache_salt)

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached page on every replica (pages in use keep theirs), and every
        page of the tiers below (host, disk, and this layout's pages in Redis)."""
        self.tiers.before_step()
        for bm in self._managers:
            bm.reset_prefix_cache()
            self._checked(bm)
        self.tiers.reset()

    # ----------------------------------------------------------------- runtime inputs
    def _check_batches(self, batches: Sequence[Sequence[TextContext]]) -> None:
        checks.check_batches(batches, self.num_replicas)

    def runtime_inputs(
        self,
        batches: Sequence[Sequence[TextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
    ) -> KVCacheInputs:
        """Tensors for one forward pass: a `KVCacheInputs` whose `.inputs` has one
        `RaggedKVCacheInputs` per device, replica-major (a `MultiKVCacheInputs`
        tree for `MultiKVCacheParams`, whose leaves share each device's lookup
        table and cache lengths). No bookkeeping changes, except that with
        ``enable_partial_page_reuse`` the pending page copies are taken and applied.

        `max_cache_length` sizes the lookup tables for that many tokens (at least what the
        batch needs). `batch_characteristics` gives upper bounds applied to every replica alike
        (graph-capture replay): each replica's ``max_lengths`` holds its `max_prompt_length` and
        `max_cache_valid_length`, and without `max_cache_length` every lookup table is
        `max_cache_valid_length` tokens wide; rows and cache lengths stay the real ones.

        Raises RuntimeError (`MissingPagesError`, also a ValueError) when a request holds too few
        pages for its tokens (call `alloc`); ValueError when a batch exceeds `max_batch_size`,
        `max_cache_length` is too small, or a replica's real batch size, longest prompt or longest
        cache exceeds the `batch_characteristics` field bounding it.
        """
        self._check_batches(batches)
        for r, batch in enumerate(batches):
            if len(batch) > self.max_batch_size:
                raise ValueError(f"replica {r} batch of {len(batch)} exceeds max_batch_size={self.max_batch_size}")
        if batch_characteristics is not None:
            checks.check_batch_characteristics(batch_characteristics, batches, self.max_batch_size)
            if max_cache_length is None:
                max_cache_length = batch_characteristics.max_cache_valid_length
        bounds = batch_characteristics
        for r in range(self.num_replicas if self.num_state_rows else 0):  # restored checkpoints land before the
            self._apply_state_copies(r)  # forward reads them (then the tiers' loads, which may replace them)
        if self.tiers.active:
            self.tiers.before_forward()
        if self.hybrid:
            pairs = zip(self._managers, batches, strict=True)
            tables = [
                [_bounded(t, bounds) for t in bm.build_group_tables(list(batch), max_cache_length)]
                for bm, batch in pairs
            ]
            if self.params.enable_partial_page_reuse:  # copy-on-write of partial-page hits, before the forward
                self._apply_page_copies()
            return hybrid.hybrid_inputs(self.params, self._buffers, tables)
        per_device: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for r, (bm, batch) in enumerate(zip(self._managers, batches, strict=True)):
            per_device.extend(self._device_tables(r, _bounded(bm.build_tables(list(batch), max_cache_length), bounds)))
        if self.params.enable_partial_page_reuse:  # copy-on-write of partial-page hits, before the forward
            self._apply_page_copies()
        return self._assemble(self.params, self._buffers, per_device)

    def _apply_page_copies(self) -> int:
        """Copy-on-write of partial-page hits (``enable_partial_page_reuse``): take each replica's pending
        copies (`take_page_copies`) and apply them to every tensor of its buffers (each cache of a tree, K and
        V of every layer, every TP shard, FP8 scales), so they land before the forward pass that reads them.
        A hybrid model's copies (one per group, page ids of the shared pool) run on every group's views of
        the arena: each copies bytes of the source row to the same offsets of the destination row, so
        another group's view of a page writes nothing its owner's view reads differently (the slots it
        copies beyond the owner's are written by the forward before anything reads them). Returns how many
        copies ran."""
        done = 0
        for bm, buffer in zip(self._managers, self._buffers, strict=True):
            copies = bm.take_page_copies()
            for tensor in buffer.all_buffers if copies else ():
                copy_page_slots(tensor, copies)
            done += len(copies)
        return done

    def _apply_state_copies(self, r: int) -> int:
        """Run replica `r`'s pending state-checkpoint copies in order (`KVCacheCoordinator.take_state_copies`):
        whole state rows, or rows and runs of attention pages (`ops.state_runs`), on every shard; then the
        attention tail slots of restored checkpoints in every attention group's buffers. Returns how many."""
        bm, buffer = self._managers[r], self._buffers[r]
        if bm.states is None:
            return 0
        copies, pages = bm.take_state_copies()
        for copy in copies:  # in order: a restore may read the row (or run) a save just wrote
            for page_arena, arena in zip(buffer.arenas, buffer.state_arenas, strict=True):
                if isinstance(copy, RunCopy):
                    copy_state_run(page_arena, arena, copy.row, copy.pages, copy.save)
                else:
                    arena[copy.dst].copy_(arena[copy.src])
        for child in buffer.children.values() if pages else ():
            for tensor in child.all_buffers if not isinstance(child, StateCacheBuffer) else ():
                copy_page_slots(tensor, pages)
        return len(copies) + len(pages)

    def num_state_checkpoints(self, replica_idx: int = 0) -> int:
        """Recurrent-state checkpoints the replica keeps now (0 for models without recurrent state)."""
        bm = self._bm(replica_idx)
        return len(bm.states) if bm.states is not None else 0

    def checkpoint_cut(self, request_id: RequestID, replica_idx: int = 0) -> int | None:
        """The next token position at which the request saves a recurrent-state checkpoint (where a cached
        prefix diverges from it, then before its prompt's last token), or None; a scheduler ends a prefill
        chunk exactly there. Always None for models without recurrent state."""
        bm = self._bm(replica_idx)
        return bm.checkpoint_cut(request_id)

    def _device_tables(
        self, r: int, tables: BatchTables
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        for s, device in enumerate(self.params.devices_per_replica[r]):
            yield r, s, *tables_to_device(tables, device.to_torch())  # [B, cols], [B], [1, 2]

    def _assemble(self, params: KVCacheParamInterface, buffers: list[Any], per_device: list[Any]) -> KVCacheInputs:
        if isinstance(params, MultiKVCacheParams):
            children = {
                name: self._assemble(child, [b.children[name] for b in buffers], per_device)
                for name, child in params.children.items()
            }
            return MultiKVCacheInputs(children)
        records = []
        for r, s, lut, lengths, max_lengths in per_device:
            buf: KVCacheBuffer = buffers[r]
            scales = buf.scales[s] if buf.scales else None
            record = RaggedKVCacheInputs(buf.values[s], lengths, lut, max_lengths, scales)
            records.append(record.with_policy(params.leaves()[0].nonfinite_kv))  # (a leaf: itself)
        return KVCacheInputs(records)

    def runtime_inputs_for_leaf(
        self,
        batches: Sequence[Sequence[TextContext]],
        *,
        max_cache_length: int | None = None,
        batch_characteristics: BatchCharacteristics | None = None,
    ) -> KVCacheInputs:
        """`runtime_inputs` for a single-cache model; TypeError for a multi-cache tree."""
        if isinstance(self.params, MultiKVCacheParams):
            raise TypeError("runtime_inputs_for_leaf needs KVCacheParams; this manager has MultiKVCacheParams")
        return self.runtime_inputs(
            batches, max_cache_length=max_cache_length, batch_characteristics=batch_characteristics
        )

    def get_device_buffer(self, replica_idx: int = 0) -> KVCacheBuffer | MultiKVCacheBuffer:
        """The replica's page buffers (a tree for multi-cache models).

        Pages `alloc` took from a tier below are filled on the tensor side, before the forward: this call
        runs the staged copies first (as `runtime_inputs` does), so every page the tables name holds its
        bytes when it returns. `LoadCopyError` if a copy failed (see `Tiering.complete_loads`: alloc again)."""
        self._bm(replica_idx)
        self.tiers.complete_loads()
        return self._buffers[replica_idx]

    # ----------------------------------------------------------------- queries
    def get_req_blocks(self, request_id: RequestID, replica_idx: int = 0, group: int = 0) -> list[int]:
        """Page ids of the request in logical order (of `group`, for hybrid models; null where dropped)."""
        bm = self._bm(replica_idx)
        checks.check_group(bm, group)
        return bm.get_req_blocks(request_id, group)

    def num_free_blocks(self, replica_idx: int = 0) -> int:
        """Pages no running request holds: fresh plus evictable cached (state checkpoints' pages included)."""
        return self.total_num_blocks(replica_idx) - self.get_num_used_pages(replica_idx)

    def total_num_blocks(self, replica_idx: int = 0) -> int:
        """Pages in the replica's pool (null page excluded)."""
        return self._bm(replica_idx).pool.num_blocks

    get_num_pages = total_num_blocks

    def get_num_used_pages(self, replica_idx: int = 0) -> int:
        """Pages running requests hold (not those only cached prefixes or state checkpoints hold: idle, 0)."""
        return self._bm(replica_idx).metrics.used_pages

    def get_pct_used_blocks_after_allocation(self, ctx: TextContext, replica_idx: int = 0) -> float:
        """Fraction of the pool in use if `alloc(ctx)` ran now (capped at 1.0). No side effects."""
        bm = self._bm(replica_idx)
        new_pages, evictable_hits = bm.pages_needed(ctx)
        return min(1.0, (self.get_num_used_pages(replica_idx) + new_pages + evictable_hits) / bm.pool.num_blocks)

    def get_metrics(self, replica_idx: int = 0) -> KVCacheMetrics:
        """One replica's counters and page usage."""
        return self._bm(replica_idx).metrics

    def get_metrics_aggregated(self) -> KVCacheMetrics:
        """Counters and page usage summed over replicas."""
        return sum((bm.metrics for bm in self._managers), start=KVCacheMetrics())

    def reset_metrics(self) -> None:
        """Zero every replica's counters."""
        for bm in self._managers:
            bm.reset_metrics()

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless every replica's bookkeeping is consistent."""
        for bm in self._managers:
            bm.check_integrity()

    # ----------------------------------------------------------------- model weights
    # The weights version is folded into the root of every prefix-cache hash chain (see
    # `pagedkv.core.hashing`): after `set_weights_version(v)` no page computed under another version
    # is a hit, on device or in any tier, with no `reset_prefix_cache`. Old pages age out unused.
    @property
    def weights_version(self) -> str | None:
        """The version new requests' hash chains start from (`KVCacheParams.weights_version` at first)."""
        return self._managers[0].hasher.version

    def set_weights_version(self, version: str | None) -> None:
        """Hash every later admission from `version`'s root, on every replica.

        Requests already holding pages keep their chains: pages they commit later stay under the old
        version's keys, which no request of the new version looks up. A request whose KV must be
        all new (an engine after a weight update) is released and recomputed by its caller.
        Raises TypeError/ValueError for a version that is not None or a str of 1 to 1024 characters.
        """
        check_weights_version(version, "version")
        for bm in self._managers:
            bm.hasher.set_version(version)

    # ----------------------------------------------------------------- swap preemption (host tier)
    @property
    def can_swap(self) -> bool:
        """True when a host tier exists (swap preemption is possible at all)."""
        return self._swapped.can_swap

    def is_swapped(self, request_id: RequestID, replica_idx: int = 0) -> bool:
        """True while `request_id` is swapped out."""
        return (replica_idx, request_id) in self._swapped

    def swapped_pages(self, request_id: RequestID, replica_idx: int = 0) -> int:
        """Pages parked in host rows for `request_id` (0 when it is not swapped out)."""
        return self._swapped.num_pages(request_id, replica_idx)

    def swap_out(self, request_id: RequestID, replica_idx: int = 0) -> bool:
        """Copy every page of the claimed `request_id` to host rows and release its device pages.

        Returns False, changing nothing, without a host tier or when the host
        tier cannot lend enough rows (the caller then preempts by recompute).
        The request's context must not be reset; resume it with `swap_in`.
        """
        bm = self._bm(replica_idx)
        swapped = self._swapped.swap_out(bm, request_id, replica_idx)
        self._checked(bm)
        return swapped

    def swap_in(self, ctx: TextContext, replica_idx: int = 0) -> None:
        """Claim ``ctx.request_id`` again with its swapped pages, bit for bit; the host rows return to
        the tier. Raises `InsufficientBlocksError` (too few device pages) or `ValueError` (not
        swapped out) and then changes nothing."""
        bm = self._bm(replica_idx)
        if not isinstance(ctx, TextContext):
            raise TypeError(f"ctx must be a TextContext, got {type(ctx).__name__}")
        self._swapped.swap_in(bm, ctx, replica_idx)
        self._checked(bm)

    # ----------------------------------------------------------------- tiers and events
    def _connector(self, replica_idx: int) -> Any:
        """The replica's connector, or None without tiers (validates `replica_idx`)."""
        self._bm(replica_idx)
        return self.tiers.connectors[replica_idx] if self.tiers.connectors else None

    def get_num_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages of the replica (0 without a host tier)."""
        return int(getattr(self._connector(replica_idx), "num_host_blocks", 0))

    def get_num_used_host_pages(self, replica_idx: int = 0) -> int:
        """Host-tier pages holding cached KV."""
        return int(getattr(self._connector(replica_idx), "num_used_host_blocks", 0))

    def get_num_disk_pages(self, replica_idx: int = 0) -> int:
        """Disk-tier pages the replica may use (its size cap; 0 without a disk tier)."""
        return int(getattr(self._connector(replica_idx), "num_disk_blocks", 0))

    def get_num_used_disk_pages(self, replica_idx: int = 0) -> int:
        """Disk-tier pages holding cached KV."""
        return int(getattr(self._connector(replica_idx), "num_used_disk_blocks", 0))

    def tier_stats(self, replica_idx: int = 0) -> dict[str, dict[str, object]]:
        """Each tier's counters (`TierStats.snapshot`) by name: "host", "disk", "redis" (and "host_states",
        "disk_states", "redis_states" for the state checkpoints of a model with recurrent state)."""
        return {name: stats.snapshot() for name, stats in self.tiers.stats(replica_idx).items()}

    def add_kv_event_listener(self, listener: Callable[[KVEventBatch], None]) -> None:
        """Call `listener(batch)` with each replica's KV events once per `step` (and on
        `reset_prefix_cache`); batches are numbered without gaps (`KVEventBatch.seq`)."""
        self.tiers.add_listener(listener)

    def remove_kv_event_listener(self, listener: Callable[[KVEventBatch], None]) -> None:
        """Stop calling `listener`."""
        self.tiers.remove_listener(listener)

    def sync_tiers(self) -> None:
        """Push every committed page still queued down the tiers and wait until all are written
        (before exiting, or before another process should find the pages)."""
        self.tiers.sync()

    def close(self) -> None:
        """`sync_tiers`, then stop the tiers' threads and connections (the manager stays usable,
        without tiers)."""
        self.tiers.close()

    # ----------------------------------------------------------------- planning
    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParamInterface,
        max_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[DeviceRef],
        **kwargs: Any,
    ) -> int:
        """Bytes the device pages will take for this budget and shape, over all replicas.

        The signature is `KVCacheManager.estimated_memory_size`'s. `num_layers` and
        `devices` repeat what `params` says and must match it (ValueError otherwise; for a
        `MultiKVCacheParams` tree `num_layers` is the sum over its caches); `kwargs` are
        accepted and ignored, as in MAX.
        """
        check_redundant_args(params, num_layers, devices)
        return memory.estimated_memory_size(params, available_cache_memory, max_batch_size, max_seq_len)

    @classmethod
    def infer_optimal_batch_size(
        cls,
        params: KVCacheParamInterface,
        max_seq_len: int,
        num_layers: int,
        available_cache_memory: int,
        devices: Sequence[DeviceRef],
        **kwargs: Any,
    ) -> int:
        """Largest batch whose sequences all reach `max_seq_len` without preemption.

        The signature is `KVCacheManager.infer_optimal_batch_size`'s; `num_layers` and
        `devices` must match `params` as in `estimated_memory_size`; `kwargs` are ignored.
        """
        check_redundant_args(params, num_layers, devices)
        return memory.infer_optimal_batch_size(params, max_seq_len, available_cache_memory)


def _bounded(tables: BatchTables, bounds: BatchCharacteristics | None) -> BatchTables:
    """`tables` with the ``max_lengths`` values replaced by the upper bounds (already checked)."""
    if bounds is None:
        return tables
    return dataclasses.replace(
        tables, max_prompt_length=bounds.max_prompt_length, max_cache_length=bounds.max_cache_valid_length
    )
