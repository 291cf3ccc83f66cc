"""`BlockManager`: one replica's request tables over a `BlockPool` (pure Python + numpy).

The request lifecycle, per replica::

    claim(rid) -> alloc(ctx) -> [model writes KV, ctx.update(tok)] -> step(ctx) -> ... -> release(rid)

- `alloc` reuses the longest cached prefix (moving ``ctx.tokens`` past it),
  then takes pages until every token, plus the speculative draft slots, has
  one. It checks everything first: on `InsufficientBlocksError` or
  `ValueError` the pool, the prefix cache, the request and the context are
  exactly as before.
- `step` commits pages whose KV was written (all ``processed_length //
  page_size`` full pages, last token excluded) to the prefix cache. A page
  whose hash is already cached is merged: the request switches to the cached
  page and its own copy is freed.
- `release` frees the pages tail first, so LRU evicts a prefix's tail before
  its head.
- With ``partial_page_reuse`` a hit also copies the matching tokens of a
  cached last partial page (copy-on-write, see `partial_pages`).

Page tables only grow, except at that merge, where an entry is swapped for a
page holding the same prefix. Prefix lookups happen only while a request
holds no uncommitted page (first admission, or after `ctx.reset()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.core.checks import check_manager_args, check_swap_restore, check_tables
from pagedkv.core.context import RequestID, Retention, TextContext, as_token_array
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.events import BlockHooks, BlockRemoved, EventSink
from pagedkv.core.groups import FullAttentionManager, GroupManager
from pagedkv.core.hashing import BlockHash, PrefixHasher, check_salt
from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.core.partial_pages import PageCopy, Partial, make_partial_pages
from pagedkv.core.pool import BlockPool
from pagedkv.core.queue_wants import QueueWants
from pagedkv.core.state.checkpoints import RunCopy, StateCheckpoints, StateCopy
from pagedkv.core.tables import (
    BatchTables,
    RequestPages,
    SwappedRequest,
    build_tables,
    check_claimed_batch,
    claimed_state,
    claimed_states,
    more_keys,
)
from pagedkv.core.tier_hits import TierGroups, TierLink

__all__ = ["BlockManager"]


class BlockManager:
    """Request page tables, prefix caching and metrics of one replica whose caches are one full-attention
    group (a `ReplicaBookkeeping`). Holds no tensors."""

    states: StateCheckpoints | None = None  # (no recurrent state)
    tiers_by_hash = True
    tier_groups = TierGroups([0], [0], -1)

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        *,
        enable_prefix_caching: bool,
        hash_algo: str = "sha256",
        hash_seed: bytes | None = None,
        num_speculative_tokens: int = 0,
        num_groups: int = 1,
        eviction_policy: str = "lru",
        protected_fraction: float = 0.25,
        evict_leaves_first: bool = False,
        partial_page_reuse: bool = False,
        commit_on_alloc: bool = False,
        commit_unscheduled: bool = True,
    ) -> None:
        check_manager_args(page_size, enable_prefix_caching, num_speculative_tokens, hash_seed, evict_leaves_first,
                           partial_page_reuse, commit_on_alloc)  # fmt: skip
        self.pool = BlockPool(num_blocks, enable_prefix_caching, num_groups, eviction_policy, protected_fraction,
                              evict_leaves_first)  # fmt: skip
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_speculative_tokens = num_speculative_tokens
        self.hasher = PrefixHasher(hash_algo, page_size, hash_seed)
        self._reqs: dict[RequestID, RequestPages] = {}
        self.wants = QueueWants(self.pool, self.hasher)  # waiting requests told by `expect`
        self._input_tokens = 0
        self._cache_tokens = 0
        self._evictions_at_reset = 0
        self.hooks = BlockHooks()
        self.tier_link: TierLink | None = None  # the tiers below, asked at a request's first alloc
        self.groups: list[GroupManager] = [FullAttentionManager(0, page_size)]  # its one group's page policy
        self._partial = make_partial_pages(partial_page_reuse, self.pool, page_size, self.hasher.root)
        self.commit_on_alloc = commit_on_alloc and enable_prefix_caching
        # (False: schedule-time commits only for an `alloc` told `num_scheduled_tokens`; a driver that chunks
        # after `alloc` without saying so would otherwise share pages its step never writes)
        self.commit_unscheduled = commit_unscheduled

    # ------------------------------------------------------------------ lifecycle
    def claim(self, request_id: RequestID, *, dummy: bool = False) -> None:
        """Start tracking `request_id` (no pages yet). A dummy maps to the null page only."""
        if request_id in self._reqs:
            raise ValueError(f"Request ID {request_id!r} is already claimed")
        self._reqs[request_id] = RequestPages(dummy=dummy)

    def contains(self, request_id: RequestID) -> bool:
        """True while `request_id` is claimed."""
        return request_id in self._reqs

    def release(self, request_id: RequestID) -> None:
        """Forget `request_id` and free its pages, tail first."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"Attempted to release request ID {request_id!r} but it is not claimed")
        del self._reqs[request_id]
        if st.unwritten >= 0:  # released between alloc and step: forget what was never written
            self._unregister(st)
        if st.num_pages:
            self.pool.free(st.pages[st.num_pages - 1 :: -1].tolist())
        if self._partial is not None:
            self._partial.drop(request_id)  # a page copy never taken: its source is free again

    def take_page_copies(self) -> list[PageCopy]:
        """Pending partial-page copies, oldest first; their sources are released (`partial_pages`:
        apply each before the next `alloc` or forward pass)."""
        return self._partial.take() if self._partial is not None else []

    def alloc(self, ctx: TextContext, num_scheduled_tokens: int | None = None) -> None:
        """Give `ctx` pages for all its tokens (+ draft slots), reusing cached prefix pages first.

        `num_scheduled_tokens` (how many tokens this step will run): full
        attention takes pages for the whole sequence, as MAX does; with
        schedule-time caching the full pages those tokens fill become
        hittable now (with `commit_on_alloc` left at None, only when it is
        given); windowed groups of a hybrid model take pages for it.

        Side effects on success: prefix hits move ``ctx.tokens`` forward
        (`skip_processing`); on a first admission ``ctx.cached_prefix_length``
        is set. Raises `InsufficientBlocksError` (capacity) or `ValueError`
        (misuse) and then changes nothing.
        """
        st = self._reqs.get(ctx.request_id)
        tokens = ctx.tokens
        # Hot path, a decode step that needs no page: one active token, every slot held.
        # (Reads TokenBuffer's fields directly: properties cost ~40% of this path.)
        if st is not None and tokens.end - tokens.processed == 1:
            if tokens.length + self.num_speculative_tokens <= st.num_pages * self.page_size:
                self._input_tokens += 1
                return
            if tokens.processed and not st.dummy and self._alloc_decode(st, ctx, num_scheduled_tokens):
                return
        st = self._claimed(ctx.request_id)
        hits, need, new_keys, digest, partial = self._plan(st, ctx)
        if need > 0:
            available = self.pool.num_free - self.pool.count_unreferenced(hits)
            if need > available:
                used, total = self.pool.num_used, self.pool.num_blocks
                raise InsufficientBlocksError.for_request(ctx.request_id, need, available, used, total)
        st.context = ctx
        if new_keys:
            st.hashes.extend(new_keys)
            st.digest = digest
        processed = tokens.processed_length
        # the tiers below are asked exactly when the device prefix cache was (see `_plan`)
        tier_lookup = self.enable_prefix_caching and tokens.active_length > 1 and st.num_pages == st.committed
        if new_keys:  # a lookup ran: the pages it missed may adapt the eviction policy (ARC's split)
            self.pool.note_misses(st.hashes[st.committed + len(hits) :])
        if hits:
            self.pool.touch(hits)
            if ctx.retention is not None:
                self.pool.retain(hits, ctx.retention.priority, ctx.retention.duration_s)
            st.append(hits)
            st.committed += len(hits)
            skip = st.committed * self.page_size - processed
            tokens.skip_processing(skip)
            self._cache_tokens += skip
        if partial is not None:  # before `allocate`, which could otherwise evict a free source
            self.pool.touch((partial[0],))
        if need > 0:
            st.append(self.pool.allocate(need))
            if tier_lookup and self.tier_link is not None and len(st.hashes) > st.committed and partial is None:
                self._from_tiers(st, ctx)  # (partial reuse and tiers: refused by KVCacheParams)
        if partial is not None and self._partial is not None:
            self._cache_tokens += self._partial.record(st, ctx, *partial)
        if processed == 0:
            ctx.cached_prefix_length = tokens.processed_length
            if self.wants:  # admitted: it holds what it hits, so its want ends
                self.unexpect(ctx.request_id)
        self._input_tokens += tokens.active_length
        if self.commit_on_alloc:
            self._commit_scheduled(st, ctx, num_scheduled_tokens)

    def _alloc_decode(self, st: RequestPages, ctx: TextContext, num_scheduled_tokens: int | None) -> bool:
        """`alloc` of an admitted request's one active token that needs new pages (a decode step's), without the
        general path's prefix lookup, partial copy and tier load, none of which applies to it. False, having
        changed nothing, when a check fails: the general path then raises its error."""
        tokens, ps, pool = ctx.tokens, self.page_size, self.pool
        need_tokens = tokens.length + self.num_speculative_tokens
        if tokens.processed > st.num_pages * ps or need_tokens > pool.num_blocks * ps:
            return False
        need = -(-need_tokens // ps) - st.num_pages
        if need > pool.num_free:
            return False
        pages = pool.allocate(need)
        if need == 1:
            st.push(pages[0])
        else:
            st.append(pages)
        self._input_tokens += 1
        if self.commit_on_alloc:
            self._commit_scheduled(st, ctx, num_scheduled_tokens)
        return True

    def _commit_scheduled(self, st: RequestPages, ctx: TextContext, num_scheduled_tokens: int | None) -> None:
        """vLLM's schedule-time caching: commit the full pages this step's chunk will write, so requests
        admitted after this one in the same step hit them (not while a page copy into them is pending)."""
        if self._partial is not None and ctx.request_id in self._partial.pending:
            return
        if num_scheduled_tokens is None and not self.commit_unscheduled:
            return
        tokens = ctx.tokens
        run = tokens.active_length if num_scheduled_tokens is None else min(num_scheduled_tokens, tokens.active_length)
        n = min(tokens.processed_length + run, len(tokens) - 1) // self.page_size
        if n > st.committed:
            self._commit(st, ctx, n, scheduled=True)

    def _from_tiers(self, st: RequestPages, ctx: TextContext) -> None:
        """Fill the new pages after the device hits from the tiers below; commit them as hits."""
        first, keys = st.committed, st.hashes[st.committed :]
        pages = st.pages[first : first + len(keys)].tolist()
        n = self.tier_link.load_pages([pages], keys) if keys and self.tier_link is not None else 0
        if n:
            used = self.pool.commit_run(pages[:n], keys[:n], int(st.pages[first - 1]) if first else -1, False)
            st.pages[first : first + n] = used  # (a page whose prefix is cached already is swapped for that copy)
            st.committed += n
            ctx.tokens.skip_processing(n * self.page_size)
            self._cache_tokens += n * self.page_size
            if self.hooks.emit is not None:
                self.hooks.committed(st.hashes, first, first + n, ctx.tokens.all, self.page_size)

    def restart_holders(self, pages: Iterable[int], rows: Iterable[int] = ()) -> list[RequestID]:
        """Roll back every request holding one of `pages` in its committed prefix (tier loads whose device copy
        failed; the tier port has taken them out of the prefix cache): it gives back its pages from the first
        such one on (tail first) and its context (the one its last `alloc` was given) moves back to that page's
        first token, so table and context are consistent at once and its next `alloc` looks the rest up again
        (device, tiers). `rows`: state rows (none here). Returns the requests rolled back. O(tables)."""
        gone, rolled, pool, ps = set(pages), [], self.pool, self.page_size
        if not gone:
            return []
        for rid, st in self._reqs.items():
            first = next((i for i, page in enumerate(st.pages[: st.committed].tolist()) if page in gone), None)
            if first is None:
                continue
            if st.unwritten >= 0:  # pages committed at alloc for a step that will not run as planned
                first = min(first, st.unwritten)
                self._unregister(st)
            pool.free(st.pages[first : st.num_pages][::-1].tolist())
            st.num_pages = st.committed = first
            if st.context is not None:  # (a request holding pages was given one by `alloc` or `swap_restore`)
                tokens = st.context.tokens
                tokens.rewind_processing(max(0, tokens.processed_length - first * ps))
                st.context.cached_prefix_length = min(st.context.cached_prefix_length, first * ps)
            rolled.append(rid)
        return rolled

    def step(self, ctx: TextContext) -> None:
        """Commit the full pages of ``ctx`` whose KV is written (no-op without prefix caching or for a dummy)."""
        self.step_batch((ctx,))

    def step_batch(self, batch: Iterable[TextContext]) -> None:
        """`step` for every context of `batch` (one call: this runs once per request per step)."""
        reqs, ps, caching = self._reqs, self.page_size, self.enable_prefix_caching
        batch = batch if isinstance(batch, list | tuple) else list(batch)
        states = claimed_states(reqs, batch)  # every request is checked before any commit
        if not caching:
            return
        for ctx, st in zip(batch, states, strict=True):
            if st.dummy:  # a dummy (padding) row has nothing to commit
                continue
            if st.unwritten >= 0:  # pages committed at alloc are written now: announce them
                first, st.unwritten = st.unwritten, -1
                self._announce(st, ctx, first, st.committed)
            tokens = ctx.tokens
            done, bound = tokens.processed, (st.committed + 1) * ps  # (hot path: fields, not properties)
            if done >= bound and tokens.length > bound:  # min(processed, len - 1) fills another page
                self._commit(st, ctx, min(done, tokens.length - 1) // ps)

    def _commit(self, st: RequestPages, ctx: TextContext, n_commit: int, scheduled: bool = False) -> None:
        """Commit pages [committed, n_commit). `scheduled`: at alloc, before their KV is written: a page
        whose hash another page holds stops it (no merge), and `_announce` waits for `step`."""
        n_commit = min(n_commit, st.num_pages)
        if n_commit > len(st.hashes):
            keys, st.digest = more_keys(self.hasher, st, ctx, n_commit)
            st.hashes.extend(keys)
        pages, hashes, first = st.pages, st.hashes, st.committed
        if n_commit > first:
            run = pages[first:n_commit].tolist()
            used = self.pool.commit_run(run, hashes[first:n_commit], pages.item(first - 1) if first else -1, scheduled)
            n_commit = first + len(used)
            if used != run[: len(used)]:  # cached copies of some of these prefix pages: share them
                pages[first:n_commit] = used
        st.committed = max(first, n_commit)
        if ctx.retention is not None:
            self.pool.retain(pages[first:n_commit].tolist(), ctx.retention.priority, ctx.retention.duration_s)
        if scheduled:
            st.unwritten = first if st.unwritten < 0 else st.unwritten
        else:
            self._announce(st, ctx, first, n_commit)

    def _unregister(self, st: RequestPages) -> None:
        """Uncache the pages committed at alloc that no step wrote (those no other request took)."""
        pool = self.pool
        for i in range(st.unwritten, st.committed):
            page = int(st.pages[i])
            if pool.ref_count(page) == 1:
                pool.forget(page)
        st.unwritten = -1

    def _announce(self, st: RequestPages, ctx: TextContext, first: int, n_commit: int) -> None:
        """Tell the partial-page index, the tiers and the event listeners about written pages [first, n_commit)."""
        hashes = st.hashes
        if self._partial is not None:
            self._partial.committed(st, ctx, first, n_commit)
        if n_commit > first and (self.hooks.offloads is not None or self.hooks.emit is not None):
            self.hooks.committed(hashes, first, n_commit, ctx.tokens.all, self.page_size)

    # ------------------------------------------------------------------ planning
    def check_batch(self, batch: Sequence[TextContext]) -> None:
        """ValueError naming the first request of `batch` that is not claimed or is there twice. No side effects."""
        check_claimed_batch(self._reqs, batch)

    def check_claimed(self, request_id: RequestID) -> None:
        """ValueError unless `request_id` is claimed and not a dummy (what `alloc` and `step` need)."""
        self._claimed(request_id)

    def _claimed(self, request_id: RequestID) -> RequestPages:
        st: RequestPages = claimed_state(self._reqs, request_id)
        return st

    def _plan(self, st: RequestPages, ctx: TextContext) -> tuple[list[int], int, list[BlockHash], bytes, Partial]:
        """(prefix-hit pages, new pages needed, keys to memoise, their digest, partial hit: (source
        page, tokens) or None). Validates; mutates nothing."""
        tokens = ctx.tokens
        ps = self.page_size
        if tokens.processed_length > st.num_pages * ps:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length={tokens.processed_length} but the cache "
                f"holds {st.num_pages * ps} of its tokens; call ctx.reset() before re-admitting it"
            )
        need_tokens = len(tokens) + self.num_speculative_tokens
        capacity = self.pool.num_blocks * ps
        if need_tokens > capacity:
            raise InsufficientBlocksError(
                f"request {ctx.request_id!r} needs {need_tokens} token slots but the whole cache holds "
                f"{capacity} ({self.pool.num_blocks} pages of {ps}); restart with a lower max seq len or more pages",
                needed=-(-need_tokens // ps),
                available=self.pool.num_blocks,
            )
        hits: list[int] = []
        new_keys: list[BlockHash] = []
        digest, partial = st.digest, None
        lookup = self.enable_prefix_caching and tokens.active_length > 1 and st.num_pages == st.committed
        if lookup:
            stop = (min(len(tokens), tokens.current_position) - 1) // ps
            if stop > st.committed:
                new_keys, digest = more_keys(self.hasher, st, ctx, stop)
                keys = [*st.hashes, *new_keys] if st.hashes else new_keys  # (a first lookup: its own keys)
                hits = self.pool.lookup(keys, st.committed, stop)
        need = -(-need_tokens // ps) - st.num_pages - len(hits)
        if lookup and self._partial is not None:
            partial = self._partial.find(ctx, [*st.hashes, *new_keys], st.committed, hits, need)
        return hits, need, new_keys, digest, partial

    def pages_needed(self, ctx: TextContext) -> tuple[int, int]:
        """(new pages, evictable hit pages) that `alloc(ctx)` would take from the free count."""
        hits, need, _, _, partial = self._plan(self._claimed(ctx.request_id), ctx)
        return max(need, 0), self.pool.count_unreferenced([*hits, *(partial[:1] if partial else ())])

    # ------------------------------------------------------------------ swap preemption
    # A swapped-out request's table taken apart and rebuilt (the tensor side copies the pages):
    #     pages, record = bm.swap_snapshot(rid)   # the caller copies `pages` out, then release(rid)
    #     todo = bm.swap_restore(ctx, record)     # same table shape; device-cached prefix pages reused
    #     (the caller copies the swapped KV into the `todo` pages)
    #     bm.swap_recommit(ctx, record)           # committed pages back in the prefix cache
    # The context is never reset: the request resumes where it stopped.
    def swap_snapshot(self, request_id: RequestID) -> tuple[list[int], SwappedRequest]:
        """The request's pages in logical order and its `SwappedRequest` (one group). No side effects. Pages
        committed at alloc whose KV no step has written yet are not recorded as committed (not recommitted)."""
        st = self._claimed(request_id)
        committed = st.unwritten if st.unwritten >= 0 else st.committed
        record = SwappedRequest(((True,) * st.num_pages,), (0,), committed, 0, tuple(st.hashes), st.digest)
        return st.pages[: st.num_pages].tolist(), record

    def swap_restore(self, ctx: TextContext, record: SwappedRequest) -> list[tuple[int, int]]:
        """Claim ``ctx.request_id`` again with a table of ``record.num_pages`` pages: the leading
        committed pages the device prefix cache still holds, then fresh pages.

        Returns ``(index in the snapshot's page list, page)`` for every fresh page (here the logical
        index): the caller must copy the swapped KV of that index into it before the next forward.
        Raises `InsufficientBlocksError` / `ValueError` and changes nothing when the pool lacks pages,
        the request is claimed or the record is not of one group.
        """
        pool = self.pool
        hits = pool.lookup(list(record.hashes), 0, record.committed) if self.enable_prefix_caching else []
        need = record.num_pages - len(hits)
        check_swap_restore(ctx.request_id, ctx.request_id in self._reqs, 1, len(record.live), False, pool, need, hits)
        st = self._reqs[ctx.request_id] = RequestPages()
        pool.touch(hits)
        fresh = pool.allocate(need)
        st.append(hits)
        st.append(fresh)
        st.hashes = list(record.hashes)
        st.digest = record.digest
        st.committed = len(hits)
        st.context = ctx
        return [(len(hits) + i, page) for i, page in enumerate(fresh)]

    def swap_recommit(self, ctx: TextContext, record: SwappedRequest) -> None:
        """Commit the restored pages that were committed before the swap (after their KV is back)."""
        st = self._claimed(ctx.request_id)
        if record.committed > st.committed:
            self._commit(st, ctx, record.committed)

    # ------------------------------------------------------------------ queries (no side effects)
    def pin_prefix(self, tokens: Any, retention: Retention, cache_salt: str | None = None) -> int:
        """Give the cached pages of the page-aligned prefix of `tokens` (as `cache_salt`'s chain) the
        priority of `retention` (SGLang's pinned prefixes; priority 35 unpins). Returns pages found."""
        array = as_token_array(tokens)
        check_salt(cache_salt)
        n = len(array) // self.page_size
        keys, _ = self.hasher.extend(array, 0, n, self.hasher.root(cache_salt)) if n else ([], b"")
        pages = self.pool.lookup(keys, 0, n)
        self.pool.set_priority(pages, retention.priority, retention.duration_s)
        return len(pages)

    def expect(self, contexts: Sequence[TextContext]) -> int:
        """Queue-aware retention (`queue_wants.QueueWants`): the pages these waiting, unclaimed requests will
        hit (their prompts' full pages, wherever cached) are evicted only after every page no waiting request
        wants, the pages of requests further back in the queue first (`BlockPool.want`). A scheduler tells it
        its waiting queue's head, in order; each want ends when the request's first `alloc` succeeds (or with
        `unexpect`). Claims nothing, changes no table and no hit. Returns how many were newly expected."""
        if not self.enable_prefix_caching:
            return 0
        reqs = self._reqs

        def started(ctx: TextContext) -> bool:  # running, or a swapped-out request that resumes where it stopped
            st = reqs.get(ctx.request_id)
            return bool(st is not None and st.num_pages or ctx.tokens.processed_length)

        return self.wants.expect(contexts, started)

    def unexpect(self, request_id: RequestID) -> None:
        """End the want `expect` recorded for `request_id` (no-op when there is none)."""
        self.wants.unexpect(request_id)

    def get_req_blocks(self, request_id: RequestID, group: int = 0) -> list[int]:
        """The page ids of `request_id` in logical order (``[null]`` for a dummy); `group` is 0 (one table)."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"request {request_id!r} is not claimed")
        return [self.pool.null_block] if st.dummy else st.pages[: st.num_pages].tolist()

    def request_ids(self) -> list[RequestID]:
        """Every claimed request id."""
        return list(self._reqs)

    @property
    def metrics(self) -> KVCacheMetrics:
        """Counters since the last `reset_metrics` and a snapshot of page usage."""
        return KVCacheMetrics.of(self.pool, self._input_tokens, self._cache_tokens, self._evictions_at_reset)

    def reset_metrics(self) -> None:
        """Zero the counters (page usage is a snapshot and stays)."""
        self._input_tokens = self._cache_tokens = 0
        self._evictions_at_reset = self.pool.num_evictions

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached page from the prefix cache; returns how many."""
        return self.pool.reset_prefix_cache()

    def build_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> BatchTables:
        """Lookup table and cache lengths for `batch` (see `BatchTables`). No side effects.

        Raises ValueError when a request is unknown, repeated, or lacks pages
        (`alloc` first), or when `max_cache_length` is below what the batch needs.
        """
        return build_tables(self._reqs, batch, self.page_size, self.num_speculative_tokens, self.pool.null_block,
                            max_cache_length)  # fmt: skip

    def build_group_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> list[BatchTables]:
        """`build_tables` as the one group's entry."""
        return [self.build_tables(batch, max_cache_length)]

    def checkpoint_cut(self, request_id: RequestID) -> int | None:
        """None: no recurrent state, no checkpoint (ValueError unless `request_id` is claimed)."""
        self._claimed(request_id)
        return None

    def take_state_copies(self) -> tuple[list[StateCopy | RunCopy], list[PageCopy]]:
        """Nothing: no recurrent state."""
        return [], []

    def set_event_sink(self, emit: EventSink | None) -> None:
        """Send KV events (pages committed and evicted) to `emit`; None stops them."""
        self.hooks.emit = emit
        self.pool.on_removed = None if emit is None else (lambda h, g: emit(BlockRemoved([h], "GPU", g)))

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless every request's committed pages hold its hashes, its other
        pages are private and unhashed, and the pool's states and reference counts match the tables."""
        check_tables(self.pool, self._reqs, self._partial)
