"""`KVCacheCoordinator`: one request lifecycle over several KV cache groups sharing one pool.

Each group (full, sliding window, chunked local, sinks, MLA, cross-attention) has its own page table per
request, filled from one `BlockPool`. The coordinator keeps `BlockManager`'s contract (claim / alloc /
step / release, atomic alloc, tail-first release) and adds, per group:

- drops: pages no later query can read return to the pool as processing moves on (null in the table);
- lazy allocation: window groups hold pages up to the active window only;
- hits: the longest prefix that every group can resume from (`hit_range`), extended from the tiers
  below when a `tier_link` is set (`tier_hits`);
- pins: a dropped page that is prefix-cached, and a cached page a hit skips because it lies before the
  window, is pinned while the request runs (were it evicted, the prefix would be unhittable). Free
  pinned pages are protected (up to `protected_fraction` of the pool): only their owner takes them
  back, and only when no other request holds pages (otherwise the caller preempts). Pages never
  dropped below `shared` (a hit or a merged commit) stay held outright.
- partial pages: with `partial_page_reuse`, a hit also copies the first tokens of the next cached page in
  every cacheable group (copy-on-write, `partial_pages.GroupPartialPages`; `take_page_copies`).

Recurrent state groups (`MambaManager`) take rows of a second pool that also keeps state checkpoints
(`state.checkpoints.StateCheckpoints`, `state.resume.StateResume`): their hits need a checkpoint exactly at the resume point. The structure is vLLM's `KVCacheCoordinator`: one `BlockPool`, one page-policy manager per group
(`groups.GroupManager`) and every request's tables (`hybrid_state.HybridRequest`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence

from pagedkv.core import hybrid_state
from pagedkv.core.checks import check_hybrid_tables, check_manager_args, check_state_args, check_swap_restore
from pagedkv.core.context import RequestID, Retention, TextContext, as_token_array
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.events import BlockHooks, BlockRemoved, EventSink
from pagedkv.core.groups import GroupManager, StepSpan
from pagedkv.core.hashing import BlockHash, PrefixHasher, check_salt
from pagedkv.core.hybrid_state import FAR, HybridRequest, Plan, find_hit
from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.core.page_supply import PageSupply
from pagedkv.core.partial_pages import PageCopy, make_group_partial_pages
from pagedkv.core.pool import BlockPool
from pagedkv.core.queue_wants import QueueWants
from pagedkv.core.state.checkpoints import Checkpoint, RunCopy, StateCheckpoints, StateCopy
from pagedkv.core.state.resume import StateResume
from pagedkv.core.tables import (
    BatchTables,
    RequestPages,
    SwappedRequest,
    check_batch,
    check_claimed_batch,
    claimed_state,
    claimed_states,
    more_keys,
    required_pages,
)
from pagedkv.core.tier_hits import TierGroups, TierLink, tier_hit

__all__ = ["KVCacheCoordinator"]


class KVCacheCoordinator:
    """Request tables, prefix caching and metrics of one replica, over `groups` sharing a pool."""

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        groups: Sequence[GroupManager],
        *,
        enable_prefix_caching: bool,
        hash_algo: str = "sha256",
        hash_seed: bytes | None = None,
        num_speculative_tokens: int = 0,
        eviction_policy: str = "lru",
        protected_fraction: float = 0.25,
        evict_leaves_first: bool = False,
        num_state_rows: int = 0,
        checkpoint_pages: int = 0,
        max_state_checkpoints: int | None = None,
        commit_on_alloc: bool = False,
        commit_unscheduled: bool = True,
        partial_page_reuse: bool = False,
    ) -> None:
        check_manager_args(page_size, enable_prefix_caching, num_speculative_tokens, hash_seed, evict_leaves_first,
                           partial_page_reuse, commit_on_alloc)  # fmt: skip
        slots = check_state_args(groups, num_state_rows, checkpoint_pages, max_state_checkpoints)
        if commit_on_alloc and slots:
            raise ValueError("commit_on_alloc=True does not support models with recurrent state (their hits need a "
                             "state checkpoint, saved by `step`)")  # fmt: skip
        self.pool = BlockPool(num_blocks, enable_prefix_caching, len(groups), eviction_policy, protected_fraction,
                              evict_leaves_first)  # fmt: skip
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_speculative_tokens = num_speculative_tokens
        self.hasher = PrefixHasher(hash_algo, page_size, hash_seed)
        self.hooks = BlockHooks()  # (device removals reach listeners through `pool.on_removed`)
        self._reqs: dict[RequestID, HybridRequest] = {}
        self._supply = PageSupply(self.pool, self._reqs)  # where allocations find pages (its view of the requests)
        self._input_tokens = 0
        self._cache_tokens = 0
        self._evictions_at_reset = 0
        self.groups = list(groups)
        self._decoder = [g for g in self.groups if g.holds_tokens]  # a page per decoder token
        self._windowed = [g for g in self.groups if g.lazy]
        self._decoder_ids = [g.group for g in self._decoder]
        self._cacheable_ids = [g.group for g in self.groups if g.cacheable]
        self._state_ids = [g.group for g in self.groups if g.state_slots]
        self.states: StateCheckpoints | None = None  # state rows and checkpoints (models with recurrent state)
        self.resume: StateResume | None = None  # where those models' requests resume, over `states`
        if slots:
            self.states = StateCheckpoints(num_state_rows, max(slots), self.pool, page_size,
                                           enabled=enable_prefix_caching, eviction_policy=eviction_policy,
                                           run_pages=checkpoint_pages, max_checkpoints=max_state_checkpoints)  # fmt: skip
            self.resume = StateResume(self.states, self.hasher, self.pool, self.groups, token_groups=self._decoder_ids,
                                      state_groups=self._state_ids, caching=enable_prefix_caching)  # fmt: skip
        self._tier_link: TierLink | None = None
        self.wants = QueueWants(self.pool, self.hasher)  # waiting requests told by `expect`
        if self.resume is not None and checkpoint_pages and enable_prefix_caching:  # (their checkpoints' runs too)
            self.wants.extra = self.resume.wanted_run
        self.tier_groups = TierGroups(self._cacheable_ids, self._decoder_ids, (self._state_ids or [-1])[0])
        self._partial = make_group_partial_pages(partial_page_reuse, self.pool, page_size, self.hasher.root,
                                                 self._cacheable_ids, bool(slots))  # fmt: skip
        self.commit_on_alloc = commit_on_alloc and enable_prefix_caching  # vLLM's schedule-time caching
        # (False: schedule-time commits only for an `alloc` told `num_scheduled_tokens`; a driver that chunks
        # after `alloc` without saying so would otherwise share pages its step never writes)
        self.commit_unscheduled = commit_unscheduled

    @property
    def tiers_by_hash(self) -> bool:
        """Whether pages can go down the tiers by hash: every token group is full attention (a window group's
        pages are dropped mid-request, so a prefix below would have holes)."""
        return all(not g.lazy and not g.reads_encoder for g in self.groups if not g.state_slots)

    @property
    def tier_link(self) -> TierLink | None:
        """The tiers below, asked at a request's first alloc (`tier_hits`); refused with partial-page reuse."""
        return self._tier_link

    @tier_link.setter
    def tier_link(self, link: TierLink | None) -> None:
        if link is not None and self._partial is not None:
            raise ValueError("partial_page_reuse=True does not support tiers below the device (a tier link)")
        self._tier_link = link

    def claim(self, request_id: object, *, dummy: bool = False) -> None:
        """Start tracking `request_id` (no pages yet). A dummy maps to the null page only."""
        if request_id in self._reqs:
            raise ValueError(f"Request ID {request_id!r} is already claimed")
        tables = [RequestPages() for _ in self.groups]
        self._reqs[request_id] = HybridRequest(tables, [g.kept_pages() for g in self.groups], dummy=dummy)

    def contains(self, request_id: RequestID) -> bool:
        """True while `request_id` is claimed."""
        return request_id in self._reqs

    def release(self, request_id: object) -> None:
        """Forget `request_id` and free every group's pages, tail first."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"Attempted to release request ID {request_id!r} but it is not claimed")
        del self._reqs[request_id]
        self._free(st, request_id)
        if self._partial is not None:
            self._partial.drop(request_id)  # page copies never taken: their sources are free again

    def _free(self, st: HybridRequest, request_id: RequestID) -> None:
        """Give back every page and state row `st` holds (`StateResume.release`: its last state may be kept); pages
        committed at alloc that no step wrote leave the prefix cache first (those no other request took)."""
        if st.unwritten >= 0:
            self._unregister(st)
        if self.resume is not None:
            self.resume.release(st, request_id)
        else:
            hybrid_state.release_pages(self.groups, self.pool, st)

    # ----------------------------------------------------------------- alloc
    def alloc(self, ctx: TextContext, num_scheduled_tokens: int | None = None) -> None:
        """Pages for the request in every group: prefix hits, drops out of windows, new pages.

        Full groups take pages for every token; windowed groups for the active
        window, or, with `num_scheduled_tokens`, for that many tokens after the
        prefix hit (the caller then chunks the context to at most that many).
        Raises `InsufficientBlocksError` or `ValueError` and then changes nothing.
        """
        st = self._reqs.get(ctx.request_id)
        tokens = ctx.tokens
        if (  # hot path: a decode step that needs no page and drops none
            st is not None
            and tokens.end - tokens.processed == 1
            and tokens.end == tokens.length  # (a one-token prefill chunk is not a decode step)
            and tokens.length + self.num_speculative_tokens <= st.ready
            and tokens.processed < st.next_drop
        ):
            self._input_tokens += 1
            st.state_at = -1  # the forward pass moves the live state on
            return
        hst = self._claimed(ctx.request_id)
        decoding = tokens.end - tokens.processed == 1 and tokens.end == tokens.length
        if decoding and self._decode_step(hst, tokens.length, tokens.processed):
            if self.commit_on_alloc:
                self._commit_scheduled(hst, ctx, num_scheduled_tokens)
            return
        first = self.tier_link is not None and tokens.processed == 0 and not hst.num_pages
        plan = self._plan_alloc(hst, ctx, num_scheduled_tokens)
        if plan.checkpoint is not None:  # the hit's row or tail page may be what is short: adopt or compute
            assert self.resume is not None
            fit = self.resume.plan_fits(plan, sum(plan.new) - self._supply.available(hst, plan))
            plan = dataclasses.replace(plan, adopt=True) if fit == "adopt" else plan
            plan = plan if fit else self._plan_alloc(hst, ctx, num_scheduled_tokens, checkpoints=False)
        if plan.rows:
            assert self.states is not None
            self.states.check_rows(plan.rows, None if plan.adopt else plan.checkpoint, ctx.request_id)
        need = sum(plan.new)
        if need:
            available = self._supply.available(hst, plan)
            if need > available and self.resume is not None and self.resume.reclaim(plan, need - available):
                available = self._supply.available(hst, plan)  # checkpoints gave their tails' pages back
            if need > available:
                used, total = self.pool.num_used, self.pool.num_blocks
                raise InsufficientBlocksError.for_request(ctx.request_id, need, available, used, total)
        self._apply(hst, ctx, plan)
        if first and self.enable_prefix_caching and tokens.active_length > 1:
            self._from_tiers(hst, ctx)
        self.wants.unexpect(ctx.request_id)  # admitted: it holds what it hits, so its want (if any) ends
        if self.commit_on_alloc:
            self._commit_scheduled(hst, ctx, num_scheduled_tokens)

    def _commit_scheduled(self, st: HybridRequest, ctx: TextContext, num_scheduled_tokens: int | None) -> None:
        """vLLM's schedule-time caching: commit the full pages this step's chunk will write, so requests admitted
        after this one in the same step hit them (`step` announces them once written)."""
        if (num_scheduled_tokens is None and not self.commit_unscheduled) or (
            self._partial is not None and ctx.request_id in self._partial.pending  # (not while a copy into them waits)
        ):
            return
        tokens = ctx.tokens
        run = tokens.end - tokens.processed
        run = run if num_scheduled_tokens is None else min(num_scheduled_tokens, run)
        n = min(tokens.processed + run, tokens.length - 1) // self.page_size
        if n > st.committed:
            self._commit_groups(st, ctx, n, scheduled=True)

    def _unregister(self, st: HybridRequest) -> None:
        """Uncache the pages committed at alloc that no step wrote (those no other request took)."""
        pool, null = self.pool, self.pool.null_block
        for g in self._cacheable_ids:
            table = st.tables[g]
            for page in table.pages[st.unwritten : min(st.committed, table.num_pages)].tolist():
                if page != null and pool.ref_count(page) == 1:
                    pool.forget(page)
        st.unwritten = -1

    def restart_holders(self, pages: Iterable[int], rows: Iterable[int] = ()) -> list[RequestID]:
        """`hybrid_state.restart_holders` on this coordinator's requests (after tier loads whose copy failed)."""
        return hybrid_state.restart_holders(self._reqs, self.groups, set(pages), set(rows), self._free)

    def _from_tiers(self, st: HybridRequest, ctx: TextContext) -> None:
        """A first alloc's hit extended from the tiers (`tier_hit`): loaded pages committed, tokens skipped."""
        assert self.tier_link is not None
        found = tier_hit(self.tier_link, self.hasher, st, ctx, self.tier_groups, self.states is not None)
        if found.pages > st.committed:
            self._commit_groups(st, ctx, found.pages)
            st.shared = max(st.shared, found.pages)
        tokens, gained = ctx.tokens, found.tokens - ctx.tokens.processed_length
        if gained > 0:
            tokens.skip_processing(gained)
            self._cache_tokens += gained
            ctx.cached_prefix_length = tokens.processed_length
        cut = max(st.cut, found.reach * self.page_size) if self.states is not None and self._cacheable_ids else -1
        st.cut = cut if tokens.processed_length < cut < len(tokens) else -1
        st.end = st.end if st.end > tokens.processed_length else -1

    def _plan_alloc(
        self, st: HybridRequest, ctx: TextContext, scheduled: int | None = None, checkpoints: bool = True
    ) -> Plan:
        tokens, ps, spec = ctx.tokens, self.page_size, self.num_speculative_tokens
        if tokens.processed_length > st.ready and tokens.processed_length > 0:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length={tokens.processed_length} but the cache holds "
                f"{st.ready} of its tokens; call ctx.reset() before re-admitting it"
            )
        if self._decoder and len(tokens) + spec > self.pool.num_blocks * ps:
            raise InsufficientBlocksError(
                f"request {ctx.request_id!r} needs {len(tokens) + spec} token slots but the whole cache holds "
                f"{self.pool.num_blocks * ps} ({self.pool.num_blocks} pages of {ps}); restart with a lower max "
                "seq len or more pages",
                needed=required_pages(len(tokens) + spec, ps),
                available=self.pool.num_blocks,
            )
        hit, digest = st.committed if st.unwritten < 0 else st.unwritten, st.digest  # (unwritten: not processed)
        hit_pages: list[list[int]] = [[] for _ in self.groups]
        pins: list[int] = []
        new_keys: list[BlockHash] = []
        checkpoint: Checkpoint | None = None
        cut = -1
        states = self.states
        fresh = states is not None and not st.tables[self._state_ids[0]].num_pages  # no live state rows yet
        lookup = (
            self.enable_prefix_caching
            and tokens.active_length > 1
            and st.num_pages == st.committed
            and st.unwritten < 0  # (an alloc again before the forward: its own unwritten pages are no hit)
            and (states is None or (fresh and tokens.processed_length == 0))  # a state resumes from its start only
        )
        if lookup:
            stop = (min(len(tokens), tokens.current_position) - 1) // ps
            if stop > st.committed or (states is not None and len(tokens) > 1):
                new_keys, digest = more_keys(self.hasher, st, ctx, stop)
                keys = [*st.hashes, *new_keys]
                hit, hit_pages, pins = find_hit(self.groups, self.pool, st, keys, stop)
                if states is not None:
                    # the attention pages' hit: where a cached prefix diverges from this one (a model of state
                    # layers only has no page to tell where: it saves at prompt ends and releases only)
                    cut = hit * ps if self._cacheable_ids else -1
                    if checkpoints:
                        assert self.resume is not None
                        checkpoint, hit, hit_pages, pins = self.resume.find(st, ctx, keys, stop)
                    else:  # (attention pages alone are no hit: the state must be computed from the start)
                        hit, hit_pages, pins = st.committed, [[] for _ in self.groups], []
        tail = 0 if checkpoint is None else len(checkpoint.tail)
        processed = max(tokens.processed_length, hit * ps + tail)
        if cut <= processed or cut >= len(tokens):
            cut = -1
        last = tokens.prompt_end - 1 if fresh and self.enable_prefix_caching else -1  # (a prompt-end cut: a hit
        last = last if last > processed else -1  # leaves the last token to compute, so it resumes before it)
        floor = max(st.shared, hit if hit > st.committed else 0)  # shared pages stay
        rows = states.slots if fresh and states is not None else 0
        found = self._partial.find(ctx, [*st.hashes, *new_keys], hit) if lookup and self._partial else None
        for partial in (found, None) if found else (None,):  # (a partial hit that does not fit is skipped)
            start = processed + (partial[1] if partial else 0)  # (drops stay those of `processed`)
            end = tokens.current_position if scheduled is None else min(tokens.current_position, start + scheduled)
            span = StepSpan(processed, end, len(tokens), spec, ctx.encoder_length)
            drops, new = [], []
            for g, gm in enumerate(self.groups):
                have = st.tables[g].num_pages + len(hit_pages[g])
                drops.append(gm.drop_range(st.dropped[g], floor, processed, have))
                new.append(gm.pages_to_add(have, span))
            plan = Plan(
                hit, hit_pages, new_keys, digest, drops, new, pins, checkpoint, rows, cut, last, partial=partial
            )
            if not partial or sum(new) + self._partial.extra_pages(partial) <= self._supply.available(st, plan):  # type: ignore[union-attr]
                break
        return plan

    def _evictable_hits(self, plan: Plan) -> int:
        null, run = self.pool.null_block, plan.checkpoint.run if plan.checkpoint is not None else ()
        run = [*run, *plan.partial[0]] if plan.partial else run  # (a partial hit's sources)
        return self.pool.count_unreferenced([*(p for pages in plan.hit_pages for p in pages if p != null), *run])

    def _apply(self, st: HybridRequest, ctx: TextContext, plan: Plan) -> None:
        tokens, ps, null = ctx.tokens, self.page_size, self.pool.null_block
        if plan.new_keys:  # a lookup ran: the pages it missed adapt the policy (ARC's split)
            st.hashes.extend(plan.new_keys)
            st.digest = plan.digest
            self.pool.note_misses(st.hashes[max(plan.hit, st.committed) :])
        processed = tokens.processed_length
        hit, st.context = plan.checkpoint, ctx  # (the context a failed tier load rewinds: `restart_holders`)
        if plan.hit > st.committed:
            for g, pages in enumerate(plan.hit_pages):
                self.pool.touch(p for p in pages if p != null)
                if ctx.retention is not None:
                    self.pool.retain([p for p in pages if p != null], ctx.retention.priority,
                                     ctx.retention.duration_s)  # fmt: skip
                st.tables[g].append(pages)
            st.pinned.extend(self.pool.pin(plan.pins, reused=True))
            st.committed = plan.hit
            st.shared = max(st.shared, plan.hit)
        if plan.rows:  # the live and draft state rows (a hit's checkpoint held first: no eviction takes it)
            assert self.resume is not None
            self.resume.take_rows(st, ctx, plan)
        skip = plan.hit * ps + (0 if hit is None else len(hit.tail)) - processed
        if skip > 0:
            tokens.skip_processing(skip)
            self._cache_tokens += skip
        if plan.partial and self._partial is not None:  # sources held before `_take`, which could evict them
            self._cache_tokens += self._partial.skip(ctx, plan.partial)
        st.state_at = -1  # the forward pass moves the live state on
        if plan.cut > 0:
            st.cut = plan.cut
        if plan.rows:
            st.end = plan.end
        if processed == 0:
            ctx.cached_prefix_length = tokens.processed_length
        self._input_tokens += tokens.active_length
        freed: list[int] = []
        for g, (lo, hi) in enumerate(plan.drops):
            table = st.tables[g].pages
            freed.extend(int(table[i]) for i in range(lo, min(hi, st.tables[g].num_pages)) if table[i] != null)
            table[lo : min(hi, st.tables[g].num_pages)] = null
            st.dropped[g] = max(st.dropped[g], hi)
        cached = self.pool.block_hash
        st.pinned.extend(self.pool.pin(p for p in freed if cached(p) is not None))  # prefix kept whole
        self.pool.free(reversed(freed))
        for g, n in enumerate(plan.new):
            if n:
                st.tables[g].append(self._supply.take(st, n))
        if hit is not None:  # state row -> live row; the tail's slots -> this request's page `plan.hit`
            assert self.resume is not None
            self.resume.restore(st, ctx.request_id, plan)
        if plan.partial and self._partial is not None:
            self._partial.record(st, ctx.request_id, plan.partial)
        self._refresh(st)

    def _refresh(self, st: HybridRequest) -> None:
        tables = st.tables
        st.ready = min([tables[g].num_pages for g in self._decoder_ids], default=FAR // self.page_size) * self.page_size
        st.next_drop = min([g.drop_threshold(st.dropped[g.group]) for g in self._windowed], default=FAR)

    def _decode_step(self, st: HybridRequest, length: int, processed: int) -> bool:
        """One decode token of a running request, done directly: drop what the window groups no
        longer read, then open the page each decoder group lacks. The same result as the general
        path; False (nothing done) when that path must decide: first alloc, a stale context, a
        dummy, or too few unprotected free pages."""
        pool, ps = self.pool, self.page_size
        if st.dummy or not st.ready or processed > st.ready:
            return False
        need = required_pages(length + self.num_speculative_tokens, ps)
        tables = st.tables
        short = [t for t in [tables[g] for g in self._decoder_ids] if t.num_pages < need]
        total = need * len(short) - sum([t.num_pages for t in short])
        if total > pool.num_free - pool.num_protected:  # drops only add free pages: this is enough
            return False
        if processed >= st.next_drop:
            self._drop(st, processed)
            st.next_drop = min([g.drop_threshold(st.dropped[g.group]) for g in self._windowed])
        if total:
            pages = pool.allocate(total)
            if total == len(short):  # one page each (no draft slots): item stores
                for table, page in zip(short, pages, strict=True):
                    table.push(page)
            else:
                i = 0
                for table in short:
                    table.append(pages[i : i + need - table.num_pages])
                    i += need - table.num_pages
            st.ready = need * ps  # every decoder table now holds `need` pages or more
        self._input_tokens += 1
        st.state_at = -1
        return True

    def _drop(self, st: HybridRequest, processed: int) -> None:
        """Return the pages no query from `processed` on reads (as `_plan_alloc` + `_apply` do)."""
        null, freed = self.pool.null_block, list[int]()
        for gm in self._windowed:
            g, table = gm.group, st.tables[gm.group]
            keep, hi = gm.drop_range(st.dropped[g], st.shared, processed, table.num_pages)
            end = min(hi, table.num_pages)
            freed.extend(p for p in table.pages[keep:end].tolist() if p != null)
            table.pages[keep:end] = null
            st.dropped[g] = hi
        cached = self.pool.block_hash
        st.pinned.extend(self.pool.pin(p for p in freed if cached(p) is not None))
        self.pool.free(reversed(freed))

    # ----------------------------------------------------------------- step
    def step(self, ctx: TextContext) -> None:
        """Commit every group's full written pages of ``ctx`` (no-op without prefix caching or for a dummy)."""
        self.step_batch((ctx,))

    def step_batch(self, batch: Iterable[TextContext]) -> None:
        """Commit every group's full written pages of each request (no-op without prefix caching)."""
        reqs, ps, caching = self._reqs, self.page_size, self.enable_prefix_caching
        batch = batch if isinstance(batch, list | tuple) else list(batch)
        states = claimed_states(reqs, batch)  # every request is checked before any commit
        for ctx, st in zip(batch, states, strict=True):
            if not caching or st.dummy:
                continue
            if st.unwritten >= 0:  # pages committed at alloc are written now: announce them
                first, st.unwritten = st.unwritten, -1
                self._announce(st, ctx, first, st.committed)
            tokens = ctx.tokens
            n_commit = min(tokens.processed, tokens.length - 1) // ps
            if n_commit > st.committed:
                self._commit_groups(st, ctx, n_commit)
            if self.resume is not None:
                self.resume.stepped(st, ctx)

    def _commit_groups(self, st: HybridRequest, ctx: TextContext, n_commit: int, scheduled: bool = False) -> None:
        """Commit pages [committed, n_commit) of every group. `scheduled`: at alloc, before their KV is written:
        the run stops before the first page whose hash another page holds (no merge), and `step` announces."""
        if n_commit > len(st.hashes):
            keys, st.digest = more_keys(self.hasher, st, ctx, n_commit)
            st.hashes.extend(keys)
        lo, pool, hashes = st.committed, self.pool, st.hashes
        if scheduled:
            n_commit = self._uncached_run(st, lo, n_commit)
            if n_commit <= lo:
                return
        for gm in self.groups:
            st.shared = max(st.shared, gm.commit(pool, st.tables[gm.group], hashes, lo, n_commit, ctx.retention))
        st.committed = n_commit
        if scheduled:
            st.unwritten = lo if st.unwritten < 0 else st.unwritten
        else:
            self._announce(st, ctx, lo, n_commit)

    def _uncached_run(self, st: HybridRequest, lo: int, hi: int) -> int:
        """The end of the run [lo, hi) before the first index whose hash another page caches in some group."""
        cached, null = self.pool.cached_page, self.pool.null_block
        for i in range(lo, hi):
            for g in self._cacheable_ids:
                table = st.tables[g]
                page = int(table.pages[i]) if i < table.num_pages else null
                held = cached(st.hashes[i], g)
                if held is not None and held != page:
                    return i
        return hi

    def _announce(self, st: HybridRequest, ctx: TextContext, lo: int, hi: int) -> None:
        """Tell the partial-page index, the tiers and the event listeners about written pages [lo, hi) of every
        cacheable group."""
        if self._partial is not None:
            self._partial.committed(st, ctx, lo, hi)
        if hi > lo and (self.hooks.emit is not None or self.hooks.offloads is not None):
            for g in self._cacheable_ids:
                self.hooks.committed(st.hashes, lo, hi, ctx.tokens.all, self.page_size, g, self.groups[g].kind)

    # ----------------------------------------------------------------- swap preemption
    # As `BlockManager`'s: the caller copies the pages out, releases, later restores, copies the bytes back
    # into the fresh pages and recommits. The context is never reset: the request resumes where it stopped.
    def swap_snapshot(self, request_id: RequestID) -> tuple[list[int], SwappedRequest]:
        """Every page the request holds (group by group, table order) and its `SwappedRequest`. No side effects."""
        st = self._claimed(request_id)
        if self.states is not None:
            raise ValueError(f"request {request_id!r}: a model with recurrent state is not swapped; preempt it by "
                             "release: its state is kept as a checkpoint and its next admission resumes from it")  # fmt: skip
        return hybrid_state.snapshot_request(st, self.pool.null_block)

    def swap_restore(self, ctx: TextContext, record: SwappedRequest) -> list[tuple[int, int]]:
        """Claim ``ctx.request_id`` again with tables shaped as before the swap: the leading committed pages
        the device prefix cache still holds in every cacheable group are reused (`hybrid_state.swap_hits`;
        null entries stay null), every other live entry takes a fresh page. Returns ``(index in the snapshot's
        page list, page)`` for every fresh page: the caller copies the swapped bytes into them before the next
        forward, then calls `swap_recommit`. Raises `InsufficientBlocksError` / `ValueError` and changes
        nothing when the pool lacks pages, the request is claimed, the record has another group count or the
        model has recurrent state."""
        pool, null = self.pool, self.pool.null_block
        hits: list[list[int]] = [[] for _ in record.live]
        h = 0
        if self.enable_prefix_caching and len(record.live) == len(self.groups):
            h, hits = hybrid_state.swap_hits(self.groups, pool, record)
        reused = [p for pages in hits for p in pages]
        need = record.num_pages - len(reused)
        check_swap_restore(ctx.request_id, ctx.request_id in self._reqs, len(self.groups), len(record.live),
                           self.states is not None, pool, need, reused)  # fmt: skip
        for pages in hits:  # (group by group, as an alloc's hit)
            pool.touch(pages)
        fresh = pool.allocate(need) if need else []
        st, todo = hybrid_state.restore_request(record, h, hits, fresh, null)
        st.context = ctx
        self._reqs[ctx.request_id] = st
        self._refresh(st)
        return todo

    def swap_recommit(self, ctx: TextContext, record: SwappedRequest) -> None:
        """Commit the restored pages that were committed before the swap (after their bytes are back);
        a page whose hash another copy now caches is merged into it."""
        st = self._claimed(ctx.request_id)
        if self.enable_prefix_caching and record.committed > st.committed:
            self._commit_groups(st, ctx, record.committed)

    # ----------------------------------------------------------------- queries
    def get_req_blocks(self, request_id: object, group: int = 0) -> list[int]:
        """Page ids of the request in group `group`, null page where dropped (``[null]`` for a dummy)."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"request {request_id!r} is not claimed")
        table = st.tables[group]
        return [self._null(group)] if st.dummy else table.pages[: table.num_pages].tolist()

    def _null(self, group: int) -> int:
        """The null page of `group`'s pool (the state rows' own for a state group)."""
        states = self.states
        return states.rows.null_block if states is not None and group in self._state_ids else self.pool.null_block

    def pages_needed(self, ctx: TextContext) -> tuple[int, int]:
        """(new pages net of drops, evictable hit pages) that `alloc(ctx)` would take. No side effects."""
        st = self._claimed(ctx.request_id)
        plan = self._plan_alloc(st, ctx)
        return max(0, sum(plan.new) - self._supply.freed_by(st, plan)), self._evictable_hits(plan)

    def build_group_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> list[BatchTables]:
        """One `BatchTables` per group. Cross-attention tables hold the encoder's pages and lengths;
        their `max_prompt_length` is the decoder's query length. No side effects."""
        states: list[HybridRequest] = check_batch(self._reqs, batch)
        nulls = [self._null(g) for g in range(len(self.groups))]
        return hybrid_state.group_tables(self.groups, states, batch, self.page_size, self.num_speculative_tokens, nulls,
                            max_cache_length)  # fmt: skip

    def build_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> BatchTables:
        """The tables of group 0 (use `build_group_tables` for every group)."""
        return self.build_group_tables(batch, max_cache_length)[0]

    def request_ids(self) -> list[RequestID]:
        """Every claimed request id."""
        return list(self._reqs)

    @property
    def metrics(self) -> KVCacheMetrics:
        """Counters since the last `reset_metrics` and a snapshot of page usage."""
        usage = self.states.page_usage() if self.states is not None else (0, 0)  # (pages only checkpoints hold)
        return KVCacheMetrics.of(self.pool, self._input_tokens, self._cache_tokens, self._evictions_at_reset, usage)

    def reset_metrics(self) -> None:
        """Zero the counters (page usage is a snapshot and stays)."""
        self._input_tokens = self._cache_tokens = 0
        self._evictions_at_reset = self.pool.num_evictions

    def reset_prefix_cache(self) -> int:
        """Drop every evictable, unpinned cached page of every group and every state checkpoint nobody
        is restoring (their tail pages with them); returns how many pages and checkpoints."""
        dropped = self.states.reset() if self.states is not None else 0
        return dropped + self.pool.reset_prefix_cache()

    def expect(self, contexts: Sequence[TextContext]) -> int:
        """Queue-aware retention over every group's pages (as `BlockManager.expect`) and the run of the state
        checkpoint each waiting request would resume from (checkpoints in rows keep their own order)."""
        started = lambda c: bool(c.tokens.processed_length) or c.request_id in self._reqs  # noqa: E731
        return self.wants.expect(contexts, started) if self.enable_prefix_caching else 0

    # ----------------------------------------------------------------- state checkpoints
    def checkpoint_cut(self, request_id: RequestID) -> int | None:
        """The next token position at which `request_id` saves a state checkpoint (set by `alloc`; None when none):
        where a cached prefix diverges from it, then before its prompt's last token (a hit leaves that token to
        compute). A scheduler ends a prefill chunk exactly there; `step` then saves the state there."""
        return self._claimed(request_id).next_cut

    def set_event_sink(self, emit: EventSink | None) -> None:
        """Send KV events to `emit` (None: stop): pages committed or evicted in each cacheable group and
        state checkpoints (one event per state group, kind "mamba"), with group index and spec kind."""
        self.hooks.emit = emit
        runs = set(self._state_ids)  # (checkpoint runs are cached in a state group: their own events say so)
        removed = None if emit is None else (lambda h, g: None if g in runs else emit(BlockRemoved([h], "GPU", g)))
        self.pool.on_removed = removed
        if self.states is not None:
            self.states.emit = emit

    def take_page_copies(self) -> list[PageCopy]:
        """Pending partial-page copies (one per cacheable group of each hit), oldest first; their sources are
        released (`partial_pages`: apply each before the next `alloc` or forward pass)."""
        return self._partial.take() if self._partial is not None else []

    def pin_prefix(self, tokens: object, retention: Retention, cache_salt: str | None = None) -> int:
        """Give the cached pages of the page-aligned prefix of `tokens` (as `cache_salt`'s chain) the priority
        of `retention` in every cacheable group (SGLang's pinned prefixes; priority 35 unpins): the pages of
        the longest prefix every group can resume from (`find_hit`), and the cached pages before a window
        group's window (shorter prefixes need them). Returns the pages of that prefix (positions, not pages
        per group). State checkpoints keep their own order (not pinned)."""
        array = as_token_array(tokens)
        check_salt(cache_salt)
        n = len(array) // self.page_size
        keys, _ = self.hasher.extend(array, 0, n, self.hasher.root(cache_salt)) if n else ([], b"")
        blank = HybridRequest([RequestPages() for _ in self.groups], [0] * len(self.groups))
        hit, entries, pins = find_hit(self.groups, self.pool, blank, keys, n)
        null = self.pool.null_block
        pages = [p for row in entries for p in row if p != null]
        self.pool.set_priority([*pages, *pins], retention.priority, retention.duration_s)
        return hit

    def take_state_copies(self) -> tuple[list[StateCopy | RunCopy], list[PageCopy]]:
        """Pending data moves of state checkpoints, in order (saves, restores' rows and tail slots); the
        owner of the buffers runs them before the next forward pass (`StateCheckpoints.take`)."""
        return self.states.take() if self.states is not None else ([], [])

    def check_batch(self, batch: Sequence[TextContext]) -> None:
        """ValueError naming the first request of `batch` that is not claimed or is there twice. No side effects."""
        check_claimed_batch(self._reqs, batch)

    def check_claimed(self, request_id: RequestID) -> None:
        """ValueError unless `request_id` is claimed and not a dummy (what `alloc` and `step` need)."""
        self._claimed(request_id)

    def _claimed(self, request_id: RequestID) -> HybridRequest:
        st: HybridRequest = claimed_state(self._reqs, request_id)
        return st

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless pool, prefix caches and every group's tables agree."""
        extra = self.states.tail_refs() if self.states is not None else Counter[int]()
        extra += self._partial.check(self._reqs) if self._partial is not None else Counter()  # copies' sources
        check_hybrid_tables(self.pool, self.groups, self._reqs, self.enable_prefix_caching, extra)
        if self.resume is not None:
            self.resume.check(self._reqs.values())
