"""`KVCacheCoordinator`: one request lifecycle over several KV cache groups sharing one pool.

Each group (full, sliding window, chunked local, sinks, MLA, cross-attention)
has its own page table per request, filled from one `BlockPool`. The
coordinator keeps `BlockManager`'s contract (claim / alloc / step / release,
atomic alloc, tail-first release) and adds, per group:

- drops: pages no later query can read return to the pool as processing
  moves on; the table keeps the null page in their place;
- lazy allocation: window groups hold pages up to the active window only;
- hits: the longest prefix that every group can resume from, i.e. the full
  groups' cached run, shortened until each window group has the pages its
  window needs just before the resume point cached (`hit_range`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.hybrid_state import _FAR, HybridRequest, Plan, check_request, prefix_misses, release_order
from pagedkv.core.managers import GroupManager
from pagedkv.core.tables import BatchTables, RequestPages, assemble_tables, check_batch, required_pages

__all__ = ["KVCacheCoordinator"]


class KVCacheCoordinator(BlockManager):
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
    ) -> None:
        super().__init__(
            num_blocks, page_size, enable_prefix_caching=enable_prefix_caching, hash_algo=hash_algo,
            hash_seed=hash_seed, num_speculative_tokens=num_speculative_tokens, num_groups=len(groups),
            eviction_policy=eviction_policy,
        )  # fmt: skip
        self.groups = list(groups)
        self._decoder = [g for g in self.groups if g.kind != "cross"]
        self._windowed = [g for g in self.groups if g.lazy]

    def claim(self, request_id: object, *, dummy: bool = False) -> None:
        """Start tracking `request_id` (no pages yet). A dummy maps to the null page only."""
        if request_id in self._reqs:
            raise ValueError(f"Request ID {request_id!r} is already claimed")
        tables = [RequestPages() for _ in self.groups]
        self._reqs[request_id] = HybridRequest(tables, [g.kept_pages() for g in self.groups], dummy=dummy)  # type: ignore[assignment]

    def release(self, request_id: object) -> None:
        """Forget `request_id` and free every group's pages, tail first."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"Attempted to release request ID {request_id!r} but it is not claimed")
        del self._reqs[request_id]
        pages, held = release_order(self, st)  # type: ignore[arg-type]
        self.pool.release(pages, held)

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
            and tokens._end - tokens._processed == 1
            and tokens._len + self.num_speculative_tokens <= st.ready  # type: ignore[attr-defined]
            and tokens._processed < st.next_drop  # type: ignore[attr-defined]
        ):
            self._input_tokens += 1
            return
        hst: HybridRequest = self._claimed(ctx.request_id)  # type: ignore[assignment]
        plan = self._plan_alloc(hst, ctx, num_scheduled_tokens)
        need = sum(plan.new)
        if need:
            available = self._available(hst, plan)
            if need > available:
                raise InsufficientBlocksError(
                    f"Cannot get {need} free blocks for request {ctx.request_id!r} (only {available} available; "
                    f"{self.pool.num_used}/{self.pool.num_blocks} blocks currently in use)",
                    needed=need,
                    available=available,
                )
        self._apply(hst, ctx, plan)

    def _plan_alloc(self, st: HybridRequest, ctx: TextContext, scheduled: int | None = None) -> Plan:
        tokens, ps, spec = ctx.tokens, self.page_size, self.num_speculative_tokens
        if tokens.processed_length > st.ready and tokens.processed_length > 0:
            raise ValueError(
                f"request {ctx.request_id!r} has processed_length={tokens.processed_length} but the cache holds "
                f"{st.ready} of its tokens; call ctx.reset() before re-admitting it"
            )
        if len(tokens) + spec > self.pool.num_blocks * ps:
            raise InsufficientBlocksError(
                f"request {ctx.request_id!r} needs {len(tokens) + spec} token slots but the whole cache holds "
                f"{self.pool.num_blocks * ps} ({self.pool.num_blocks} pages of {ps}); restart with a lower max "
                "seq len or more pages",
                needed=required_pages(len(tokens) + spec, ps),
                available=self.pool.num_blocks,
            )
        hit, digest = st.committed, st.digest
        hit_pages: list[list[int]] = [[] for _ in self.groups]
        new_keys: list[BlockHash] = []
        if self.enable_prefix_caching and tokens.active_length > 1 and st.num_pages == st.committed:
            stop = (min(len(tokens), tokens.current_position) - 1) // ps
            if stop > st.committed:
                new_keys, digest = self._more_hashes(st, ctx, stop)  # type: ignore[arg-type]
                hit, hit_pages = self._find_hit(st, [*st.hashes, *new_keys], stop)
        processed = max(tokens.processed_length, hit * ps)
        drops, new = [], []
        for g, gm in enumerate(self.groups):
            have = st.tables[g].num_pages + len(hit_pages[g])
            if gm.kind == "cross":
                drops.append((0, 0))
                new.append(required_pages(ctx.encoder_length, ps) if have == 0 else 0)
                continue
            keep = max(st.dropped[g], st.shared, hit if hit > st.committed else 0)  # shared pages stay
            drops.append((keep, max(st.dropped[g], keep, min(gm.droppable_pages(processed), have))))
            end = len(tokens)
            if gm.lazy:
                end = (
                    tokens.current_position
                    if scheduled is None
                    else min(tokens.current_position, processed + scheduled)
                )
            new.append(max(0, required_pages(end + spec, ps) - have))
        return Plan(hit, hit_pages, new_keys, digest, drops, new)

    def _find_hit(self, st: HybridRequest, keys: list[BlockHash], stop: int) -> tuple[int, list[list[int]]]:
        """Longest resume point in (committed, stop] valid for every cacheable group, and each group's entries."""
        start, null, pool = st.committed, self.pool.null_block, self.pool
        runs: dict[int, list[int]] = {}
        top = stop
        for g, gm in enumerate(self.groups):
            if gm.cacheable and not gm.lazy:
                runs[g] = pool.lookup(keys, start, stop, g)
                top = min(top, start + len(runs[g]))
        found: dict[int, list[int | None]] = {
            g: [pool.cached_page(keys[i], g) for i in range(start, top)] for g, gm in enumerate(self.groups) if gm.lazy
        }
        misses = {g: prefix_misses(pages) for g, pages in found.items()}
        hit = start
        for h in range(top, start, -1):
            if all(self._window_ok(g, h, start, misses[g]) for g in found):
                hit = h
                break
        entries: list[list[int]] = []
        for g, gm in enumerate(self.groups):
            if g in runs:
                entries.append(runs[g][: hit - start])
            elif g in found:
                lo, _ = gm.hit_range(hit)
                kept = gm.kept_pages()
                entries.append([p if (i >= lo or i < kept) and p is not None else null  # type: ignore[misc]
                                for i, p in zip(range(start, hit), found[g], strict=False)])  # fmt: skip
            else:
                entries.append([])
        return hit, entries

    def _window_ok(self, g: int, h: int, start: int, misses: list[int]) -> bool:
        gm = self.groups[g]
        lo, _ = gm.hit_range(h)
        lo = max(lo, start)
        if misses[h - start] - misses[lo - start]:
            return False
        kept = min(gm.kept_pages(), h)
        return kept <= start or misses[kept - start] == 0

    def _freed_by(self, st: HybridRequest, plan: Plan) -> int:
        null, ref = self.pool.null_block, self.pool.ref_count
        count = 0
        for g, (lo, hi) in enumerate(plan.drops):
            pages = st.tables[g].pages
            count += sum(
                1 for i in range(lo, min(hi, st.tables[g].num_pages)) if pages[i] != null and ref(int(pages[i])) == 1
            )
        return count

    def _available(self, st: HybridRequest, plan: Plan) -> int:
        """Pages this alloc may take: fresh, LRU and probation ones, plus the request's own protected
        pages (out-of-window pages it dropped, including this alloc's drops). Other requests'
        protected pages are never taken: they keep running requests' prefixes whole."""
        pool, null = self.pool, self.pool.null_block
        hits = {p for pages in plan.hit_pages for p in pages if p != null}
        own = sum(1 for p in st.protected if pool.is_protected(p) and p not in hits)
        open_hits = sum(1 for p in hits if pool.ref_count(p) == 0 and not pool.is_protected(p))
        return pool.num_free - pool.num_protected - open_hits + own + self._freed_by(st, plan)

    def _evictable_hits(self, plan: Plan) -> int:
        null = self.pool.null_block
        return self.pool.count_unreferenced(p for pages in plan.hit_pages for p in pages if p != null)

    def _apply(self, st: HybridRequest, ctx: TextContext, plan: Plan) -> None:
        tokens, ps, null = ctx.tokens, self.page_size, self.pool.null_block
        if plan.new_keys:
            st.hashes.extend(plan.new_keys)
            st.digest = plan.digest
        processed = tokens.processed_length
        if plan.hit > st.committed:
            for g, pages in enumerate(plan.hit_pages):
                self.pool.touch(p for p in pages if p != null)
                st.tables[g].append(pages)
            st.committed = plan.hit
            st.shared = max(st.shared, plan.hit)
            skip = plan.hit * ps - processed
            tokens.skip_processing(skip)
            self._cache_tokens += skip
        if processed == 0:
            ctx.cached_prefix_length = tokens.processed_length
        self._input_tokens += tokens.active_length
        freed: list[int] = []
        for g, (lo, hi) in enumerate(plan.drops):
            table = st.tables[g].pages
            freed.extend(int(table[i]) for i in range(lo, min(hi, st.tables[g].num_pages)) if table[i] != null)
            table[lo : min(hi, st.tables[g].num_pages)] = null
            st.dropped[g] = max(st.dropped[g], hi)
        self.pool.free(reversed(freed), protect=True)  # kept whole until the request ends
        protected = self.pool.is_protected
        st.protected = [p for p in (*st.protected, *freed) if protected(p)]
        for g, n in enumerate(plan.new):
            if n:
                st.tables[g].append(self._take(st, n))
        self._refresh(st)

    def _take(self, st: HybridRequest, n: int) -> list[int]:
        """`n` pages: fresh, probation and LRU first, then the oldest of the request's own protected."""
        pool = self.pool
        k = min(n, pool.num_free - pool.num_protected)
        pages = pool.allocate(k, protected_ok=False) if k else []
        if k < n:
            own, st.protected = st.protected[: n - k], st.protected[n - k :]
            pages.extend(pool.take(own))
        return pages

    def _refresh(self, st: HybridRequest) -> None:
        ps = self.page_size
        st.ready = min((st.tables[g.group].num_pages * ps for g in self._decoder), default=_FAR)
        st.next_drop = min((g.drop_threshold(st.dropped[g.group]) for g in self._windowed), default=_FAR)

    # ----------------------------------------------------------------- step
    def step_batch(self, batch: Iterable[TextContext]) -> None:
        """Commit every group's full written pages of each request (no-op without prefix caching)."""
        reqs, ps, caching = self._reqs, self.page_size, self.enable_prefix_caching
        for ctx in batch:
            st = reqs.get(ctx.request_id)
            if st is None:
                raise ValueError(f"request {ctx.request_id!r} is not claimed: call claim() first")
            if not caching or st.dummy:
                continue
            tokens = ctx.tokens
            n_commit = min(tokens._processed, tokens._len - 1) // ps
            if n_commit > st.committed:
                self._commit_groups(st, ctx, n_commit)  # type: ignore[arg-type]

    def _commit_groups(self, st: HybridRequest, ctx: TextContext, n_commit: int) -> None:
        if n_commit > len(st.hashes):
            keys, st.digest = self._more_hashes(st, ctx, n_commit)  # type: ignore[arg-type]
            st.hashes.extend(keys)
        null, commit = self.pool.null_block, self.pool.commit
        for g, gm in enumerate(self.groups):
            if not gm.cacheable:
                continue
            table = st.tables[g]
            for i in range(st.committed, min(n_commit, table.num_pages)):
                page = int(table.pages[i])
                if page != null:
                    used = commit(page, st.hashes[i], g)
                    if used != page:  # merged into a cached copy: this prefix is shared
                        st.shared = max(st.shared, i + 1)
                        table.pages[i] = used
        st.committed = n_commit

    # ----------------------------------------------------------------- queries
    def get_req_blocks(self, request_id: object, group: int = 0) -> list[int]:
        """Page ids of the request in group `group`, null page where dropped (``[null]`` for a dummy)."""
        st = self._reqs.get(request_id)
        if st is None:
            raise ValueError(f"request {request_id!r} is not claimed")
        table = st.tables[group]  # type: ignore[attr-defined]
        return [self.pool.null_block] if st.dummy else table.pages[: table.num_pages].tolist()

    def pages_needed(self, ctx: TextContext) -> tuple[int, int]:
        """(new pages net of drops, evictable hit pages) that `alloc(ctx)` would take. No side effects."""
        st: HybridRequest = self._claimed(ctx.request_id)  # type: ignore[assignment]
        plan = self._plan_alloc(st, ctx)
        return max(0, sum(plan.new) - self._freed_by(st, plan)), self._evictable_hits(plan)

    def build_group_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> list[BatchTables]:
        """One `BatchTables` per group (cross-attention: encoder pages and lengths). No side effects."""
        states: list[HybridRequest] = check_batch(self._reqs, batch)
        ps, spec = self.page_size, self.num_speculative_tokens
        out = []
        for g, gm in enumerate(self.groups):
            rows, lengths, ends = [], [], []
            for ctx, st in zip(batch, states, strict=True):
                tokens = ctx.tokens
                if gm.kind == "cross":  # queries attend the encoder's tokens, all of them already stored
                    cached = end = slots = ctx.encoder_length
                else:
                    cached, end = tokens.processed_length, tokens.current_position
                    slots = (end if gm.lazy else len(tokens)) + spec
                rows.append((ctx.request_id, st.tables[g], 0 if st.dummy else required_pages(slots, ps)))
                lengths.append(cached)
                ends.append(end)
            out.append(assemble_tables(rows, lengths, ends, ps, self.pool.null_block, max_cache_length))
        return out

    def build_tables(self, batch: list[TextContext], max_cache_length: int | None = None) -> BatchTables:
        """The tables of group 0 (use `build_group_tables` for every group)."""
        return self.build_group_tables(batch, max_cache_length)[0]

    def check_integrity(self) -> None:
        """Raise `IntegrityError` unless pool, prefix caches and every group's tables agree."""
        null = self.pool.null_block
        holders: Counter[int] = Counter()
        for rid, st in self._reqs.items():
            hst: HybridRequest = st  # type: ignore[assignment]
            _require(hst.committed <= len(hst.hashes) or not self.enable_prefix_caching,
                     f"request {rid!r}: committed={hst.committed} exceeds its hashes")  # fmt: skip
            for table in hst.tables:
                holders.update(p for p in table.pages[: table.num_pages].tolist() if p != null)
            check_request(self, rid, hst)
        self.pool.check_integrity(holders)
