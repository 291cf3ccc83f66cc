"""`ReplicaBookkeeping`: what one data-parallel replica's bookkeeping answers (pure Python).

`PagedKVCacheManager`, its tiers, its checks and the engine's scheduler talk to a replica's bookkeeping only
through this protocol. `KVCacheCoordinator` (one page table per KV cache group over one pool) implements it;
so does `BlockManager`, the bookkeeping of a model whose caches are all one full-attention group. Every
method validates before it mutates: a call that raises changes nothing.

The lifecycle of a request::

    claim(rid) -> alloc(ctx) -> [model writes KV, ctx.update(tok)] -> step_batch([ctx]) -> ... -> release(rid)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pagedkv.core.context import RequestID, Retention, TextContext
from pagedkv.core.events import BlockHooks, EventSink
from pagedkv.core.groups import GroupManager
from pagedkv.core.hashing import PrefixHasher
from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.core.partial_pages import PageCopy
from pagedkv.core.pool import BlockPool
from pagedkv.core.queue_wants import QueueWants
from pagedkv.core.state.checkpoints import RunCopy, StateCheckpoints, StateCopy
from pagedkv.core.tables import BatchTables, SwappedRequest
from pagedkv.core.tier_hits import TierGroups, TierLink

__all__ = ["ReplicaBookkeeping"]


class ReplicaBookkeeping(Protocol):
    """One replica's request tables, prefix cache and counters. Holds no tensors."""

    pool: BlockPool  # the replica's pages and their eviction order
    page_size: int
    hasher: PrefixHasher  # the prefix hash chain (its weights version included)
    hooks: BlockHooks  # tier loader, offload runs and event sink of the page side
    wants: QueueWants  # queue-aware retention (`expect`)
    enable_prefix_caching: bool
    num_speculative_tokens: int
    states: StateCheckpoints | None  # recurrent-state rows and checkpoints; None for a model without state
    tier_groups: TierGroups  # which groups go down the tiers by hash, which hold tokens, which holds state
    groups: list[GroupManager]  # one page policy per KV cache group: one page table each, in this order
    tier_link: TierLink | None  # the tiers below (set by the manager's tier port), asked at a first alloc

    @property
    def tiers_by_hash(self) -> bool:
        """Whether every page can go down the tiers under its prefix hash."""

    # ----------------------------------------------------------------- lifecycle
    def claim(self, request_id: RequestID, *, dummy: bool = False) -> None:
        """Start tracking `request_id` with no pages. ValueError if it is claimed already."""

    def contains(self, request_id: RequestID) -> bool:
        """True while `request_id` is claimed."""

    def alloc(self, ctx: TextContext, num_scheduled_tokens: int | None = None) -> None:
        """Pages for every token of `ctx` the next forward needs, prefix hits first (they move ``ctx.tokens``
        past the cached prefix). `InsufficientBlocksError` or `ValueError`, and then nothing changed."""

    def step(self, ctx: TextContext) -> None:
        """Commit the written full pages of `ctx` to the prefix cache (`step_batch` of one)."""

    def step_batch(self, batch: Iterable[TextContext]) -> None:
        """Commit every request's written full pages; every request is checked before any commit."""

    def release(self, request_id: RequestID) -> None:
        """Forget `request_id` and free its pages, tail first. ValueError if it is not claimed."""

    # ----------------------------------------------------------------- swap preemption
    def swap_snapshot(self, request_id: RequestID) -> tuple[list[int], SwappedRequest]:
        """The pages to copy out and the record `swap_restore` takes. No side effects."""

    def swap_restore(self, ctx: TextContext, record: SwappedRequest) -> list[tuple[int, int]]:
        """Claim ``ctx.request_id`` again shaped as `record`; returns (index in the snapshot, fresh page) for
        every page whose bytes the caller copies back before the next forward."""

    def swap_recommit(self, ctx: TextContext, record: SwappedRequest) -> None:
        """Commit the restored pages that were committed before the swap (their bytes are back)."""

    def restart_holders(self, pages: Iterable[int], rows: Iterable[int] = ()) -> list[RequestID]:
        """After tier loads whose device copy failed into `pages` (already out of the prefix cache) or state
        `rows`: every request holding one goes back to before it, table and context consistent. Returns them."""

    # ----------------------------------------------------------------- retention and pinning
    def expect(self, contexts: Sequence[TextContext]) -> int:
        """Queue-aware retention: what these waiting requests will hit is evicted last. Returns how many new."""

    def pin_prefix(self, tokens: Any, retention: Retention, cache_salt: str | None = None) -> int:
        """Give the cached pages of the page-aligned prefix of `tokens` `retention`'s priority; returns pages."""

    # ----------------------------------------------------------------- data moves for the tensor side
    def take_page_copies(self) -> list[PageCopy]:
        """Pending partial-page copies (copy-on-write of a partial hit); apply them before the next forward."""

    def take_state_copies(self) -> tuple[list[StateCopy | RunCopy], list[PageCopy]]:
        """Pending state-checkpoint saves and restores, in order, and their tail-slot copies."""

    def set_event_sink(self, emit: EventSink | None) -> None:
        """Send KV events (pages stored and removed, state checkpoints) to `emit`; None stops them."""

    # ----------------------------------------------------------------- queries (no side effects)
    def check_batch(self, batch: Sequence[TextContext]) -> None:
        """ValueError naming the first request of `batch` that is not claimed or is there twice."""

    def check_claimed(self, request_id: RequestID) -> None:
        """ValueError unless `request_id` is claimed and not a dummy."""

    def checkpoint_cut(self, request_id: RequestID) -> int | None:
        """Where the request next saves a state checkpoint (None: nowhere, or no recurrent state)."""

    def pages_needed(self, ctx: TextContext) -> tuple[int, int]:
        """(new pages, evictable hit pages) that `alloc(ctx)` would take now."""

    def get_req_blocks(self, request_id: RequestID, group: int = 0) -> list[int]:
        """The page ids of `request_id`'s table `group`, in logical order."""

    def build_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> BatchTables:
        """Lookup table and cache lengths of table 0 for `batch`."""

    def build_group_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> list[BatchTables]:
        """One `BatchTables` per page table, in group order."""

    def request_ids(self) -> list[RequestID]:
        """Every claimed request id."""

    @property
    def metrics(self) -> KVCacheMetrics:
        """Counters since the last `reset_metrics` and a snapshot of page usage."""

    def reset_metrics(self) -> None:
        """Zero the counters."""

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached page (and unused state checkpoint); returns how many."""

    def check_integrity(self) -> None:
        """`IntegrityError` unless pool, prefix cache and every table agree."""
