"""Per-request state of `KVCacheCoordinator`, the prefix-hit search over its groups, a swapped-out request's
snapshot and restore (`snapshot_request`, `swap_hits`, `restore_request`) and the giving back of a request's
pages (`release_pages`, `restart_holders`) (pure Python)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.context import TextContext
from pagedkv.core.groups import FAR, GroupManager
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool import BlockPool
from pagedkv.core.tables import BatchTables, RequestPages, SwappedRequest, assemble_tables, required_pages

__all__ = [
    "FAR", "HybridRequest", "Plan", "find_hit", "group_tables", "prefix_misses", "release_order",
    "release_pages", "restart_holders", "restore_request", "snapshot_request", "swap_hits",
]  # fmt: skip


@dataclass(slots=True, eq=False)
class HybridRequest:
    """One request's tables (one per group) and its progress through the prefix cache."""

    tables: list[RequestPages]
    dropped: list[int]  # per group: entries [kept, dropped) are null (returned to the pool) unless shared
    committed: int = 0  # leading logical pages committed in every cacheable group
    shared: int = 0  # leading pages this request shares with the cache (hit or merged): never dropped
    pinned: list[tuple[int, int]] = field(default_factory=list)  # (page, stamp) pins on its out-of-window pages
    hashes: list[BlockHash] = field(default_factory=list)
    digest: bytes = b""
    dummy: bool = False
    ready: int = 0  # token slots every decoder group holds pages for (decode fast path)
    next_drop: int = FAR  # processed position at which some group drops its next page
    state_at: int = -1  # token position the live state rows hold (-1: being moved by a forward pass)
    cut: int = -1  # token position at which to save a state checkpoint (a cached prefix diverges there)
    end: int = -1  # the prompt-end checkpoint's position, its last token excluded (-1: saved, passed or none)
    ctx: Any = None  # the context of its last step (its tokens key a checkpoint saved at release)
    superseded: list[Any] = field(default_factory=list)  # its prompt-end checkpoint, the one it resumed from
    root: bytes = b""  # the hash chain's root when its state rows were taken (a weights update changes it)
    context: Any = None  # the context its last `alloc` was given (a failed tier load rewinds it: `restart_holders`)
    unwritten: int = -1  # first page committed at alloc whose KV no step has written yet (-1: none)

    @property
    def num_pages(self) -> int:
        """Logical pages of the longest decoder table."""
        return max((t.num_pages for t in self.tables), default=0)

    @property
    def next_cut(self) -> int | None:
        """The next position at which a state checkpoint is due (a divergence cut, then `end`), or None."""
        cut = self.cut if self.cut > 0 else self.end
        return cut if cut > 0 else None


def snapshot_request(st: HybridRequest, null: int) -> tuple[list[int], SwappedRequest]:
    """Every page `st` holds (group by group, table order) and the `SwappedRequest` that rebuilds it. Pages
    committed at alloc whose KV no step has written yet are not recorded as committed (not recommitted)."""
    tables = [t.pages[: t.num_pages].tolist() for t in st.tables]
    committed = st.unwritten if st.unwritten >= 0 else st.committed
    record = SwappedRequest(
        tuple(tuple(p != null for p in table) for table in tables), tuple(st.dropped), committed, st.shared,
        tuple(st.hashes), st.digest,
    )  # fmt: skip
    return [p for table in tables for p in table if p != null], record


def swap_hits(groups: Sequence[GroupManager], pool: BlockPool, record: SwappedRequest) -> tuple[int, list[list[int]]]:
    """The device-cached prefix a restore of `record` reuses: ``(h, pages)``, h the longest run of its committed
    pages such that, at every index below it, every cacheable group's live entry has its page still cached
    under that index's hash in that group; ``pages[g]`` the cached pages of group g's live entries below h
    (empty for a group that caches nothing). No side effects."""
    cacheable = [g for g, gm in enumerate(groups) if gm.cacheable and g < len(record.live)]
    cached, hashes = pool.cached_page, record.hashes
    found: list[list[int]] = [[] for _ in groups]
    h = 0
    for i in range(min(record.committed, len(hashes))):
        row = [(g, cached(hashes[i], g)) for g in cacheable if i < len(record.live[g]) and record.live[g][i]]
        if any(page is None for _, page in row):
            break
        for g, page in row:
            found[g].append(page)  # type: ignore[arg-type]
        h = i + 1
    return h, found


def restore_request(
    record: SwappedRequest, h: int, hits: list[list[int]], fresh: list[int], null: int
) -> tuple[HybridRequest, list[tuple[int, int]]]:
    """A request shaped as `record`, committed up to `h`: each group's live entries below h are its `hits`
    (`swap_hits`), the other live entries `fresh` (in snapshot order). Returns it and ``(index in the
    snapshot's page list, page)`` for every fresh page (those whose bytes the caller copies back)."""
    st = HybridRequest([RequestPages() for _ in record.live], list(record.dropped), committed=h)
    taken, reused = iter(fresh), [iter(pages) for pages in hits]  # (one list per group)
    todo: list[tuple[int, int]] = []
    index = 0
    for g, (table, live) in enumerate(zip(st.tables, record.live, strict=True)):
        entries = []
        for i, alive in enumerate(live):
            if not alive:
                entries.append(null)
                continue
            page = next(reused[g], None) if i < h else None  # (a group that caches nothing has no hits)
            if page is None:
                page = next(taken)
                todo.append((index, page))
            entries.append(page)
            index += 1
        if entries:
            table.append(entries)
    st.hashes, st.digest, st.shared = list(record.hashes), record.digest, record.shared
    return st, todo


@dataclass(frozen=True, eq=False)
class Plan:
    """What one `alloc` will do, computed before anything changes."""

    hit: int  # logical pages after the prefix hit
    hit_pages: list[list[int]]  # per group: entries to append for the hit (null where not needed)
    new_keys: list[BlockHash]
    digest: bytes
    drops: list[tuple[int, int]]  # per group: entry range to null out
    new: list[int]  # per group: pages to allocate
    pins: list[int]  # cached pages of the hit out of the window: pinned, not held
    checkpoint: Any = None  # the state checkpoint the hit resumes from (`checkpoints.Checkpoint`)
    rows: int = 0  # state rows to allocate (live and draft slots)
    cut: int = -1  # where a cached prefix diverges from this request (a checkpoint is saved there)
    end: int = -1  # where its prompt-end checkpoint is saved: before the prompt's last token (-1: none)
    adopt: bool = False  # the hit's checkpoint row becomes the live row (rows are short, it is free)
    partial: Any = None  # a partial-page hit after `hit`: (source page per cacheable group, tokens to copy)


def prefix_misses(pages: list[int | None]) -> list[int]:
    """misses[k] = how many of pages[:k] are None."""
    out = [0]
    for p in pages:
        out.append(out[-1] + (p is None))
    return out


def release_order(groups: Sequence[GroupManager], pool: BlockPool, st: HybridRequest) -> tuple[list[int], list[bool]]:
    """Every attention group's pages (state rows are another pool's), deepest position first, groups
    interleaved; dropped window pages still cached come along unheld, so they get the same recency as the rest of the prefix.

    LRU then evicts a prefix position in every group at about the same time: a window
    group never loses the pages a hit needs while the full group's pages of that prefix
    (useless without them) stay cached, which is how vLLM's hit rate collapses.
    """
    null, cached = pool.null_block, pool.cached_page
    tables = [
        [] if gm.state_slots else t.pages[: t.num_pages].tolist() for gm, t in zip(groups, st.tables, strict=True)
    ]
    pages: list[int] = []
    held: list[bool] = []
    for i in range(max((len(t) for t in tables), default=0) - 1, -1, -1):
        for g, table in enumerate(tables):
            if i < len(table) and table[i] != null:
                pages.append(table[i])
                held.append(True)
            elif i < min(st.committed, len(st.hashes)) and groups[g].cacheable:
                page = cached(st.hashes[i], g)
                if page is not None:
                    pages.append(page)
                    held.append(False)
    return pages, held


def release_pages(groups: Sequence[GroupManager], pool: BlockPool, st: HybridRequest) -> list[int]:
    """Give back every attention page `st` holds: its pins, then its pages in `release_order` (returned, in
    that order). Its tables and state rows are left as they are (the caller forgets or replaces `st`)."""
    pool.unpin(st.pinned)
    pages, held = release_order(groups, pool, st)
    pool.release(pages, held)
    return pages


def restart_holders(
    reqs: dict[Any, HybridRequest], groups: Sequence[GroupManager], pages: set[int], rows: set[int],
    release: Callable[[HybridRequest, Any], None],
) -> list[Any]:  # fmt: skip
    """After tier loads whose device copy failed (into `pages`, already out of the prefix cache, or checkpoint
    images into live state `rows`): every request of `reqs` (a coordinator's, over `groups`) that holds one of
    them in a token group, or resumes in one of those rows, gives back all it holds (`release(st, request_id)`;
    its live state is not what it claims, so ``st.state_at`` is cleared first: no checkpoint is kept of it) and
    stays claimed in `reqs`, holding nothing, its context (the one its last alloc served) back at the first
    token: table and context are consistent at once, and its next `alloc` looks its prefix up again (device,
    tiers) as at admission. Returns the requests restarted."""
    state_groups = [g.group for g in groups if g.state_slots]
    restarted = []
    for rid, st in list(reqs.items()):
        held = [t.pages[: t.num_pages].tolist() for t in st.tables]
        if not any(rows.intersection(held[g][:1]) if g in state_groups else pages.intersection(held[g])
                   for g in range(len(held))):  # fmt: skip
            continue
        st.state_at = -1
        release(st, rid)
        reqs[rid] = HybridRequest([RequestPages() for _ in groups], [g.kept_pages() for g in groups],
                                  dummy=st.dummy, context=st.context)  # fmt: skip
        if st.context is not None:
            st.context.tokens.rewind_processing(st.context.tokens.processed_length)
            st.context.cached_prefix_length = 0
        restarted.append(rid)
    return restarted


def find_hit(
    groups: Sequence[GroupManager],
    pool: BlockPool,
    st: HybridRequest,
    keys: list[BlockHash],
    stop: int,
    accept: Callable[[int], bool] | None = None,
) -> tuple[int, list[list[int]], list[int]]:
    """Longest resume point in (committed, stop] valid for every cacheable group, each group's
    entries (null out of the window), and the cached pages out of the window (to pin). With
    `accept`, the longest in [committed, stop] that `accept` also takes (a state checkpoint there)."""
    start, null = st.committed, pool.null_block
    runs: dict[int, list[int]] = {}
    top = stop
    for g, gm in enumerate(groups):
        if gm.cacheable and not gm.lazy:
            runs[g] = pool.lookup(keys, start, stop, g)
            top = min(top, start + len(runs[g]))
    found: dict[int, list[int | None]] = {
        g: [pool.cached_page(keys[i], g) for i in range(start, top)] for g, gm in enumerate(groups) if gm.lazy
    }
    misses = {g: prefix_misses(pages) for g, pages in found.items()}
    hit = start
    for h in range(top, start - (accept is not None), -1):
        if all(_window_ok(groups[g], h, start, misses[g]) for g in found) and (accept is None or accept(h)):
            hit = h
            break
    entries: list[list[int]] = []
    pins: list[int] = []
    for g, gm in enumerate(groups):
        if g in runs:
            entries.append(runs[g][: hit - start])
        elif g in found:
            lo, _ = gm.hit_range(hit)
            kept = gm.kept_pages()
            row = found[g][: hit - start]
            needed = [i >= lo or i < kept for i in range(start, hit)]
            entries.append([p if need and p is not None else null for p, need in zip(row, needed, strict=True)])
            pins.extend(p for p, need in zip(row, needed, strict=True) if not need and p is not None)
        else:
            entries.append([])
    return hit, entries, pins


def _window_ok(gm: GroupManager, h: int, start: int, misses: list[int]) -> bool:
    lo, _ = gm.hit_range(h)
    lo = max(lo, start)
    if misses[h - start] - misses[lo - start]:
        return False
    kept = min(gm.kept_pages(), h)
    return kept <= start or misses[kept - start] == 0


def group_tables(
    groups: Sequence[GroupManager], states: Sequence[HybridRequest], batch: Sequence[TextContext], page_size: int,
    spec: int, nulls: Sequence[int], max_cache_length: int | None,
) -> list[BatchTables]:  # fmt: skip
    """One `BatchTables` per group for `batch` (whose request states are `states`; `nulls[g]` is group g's
    null page). Cross-attention tables hold the encoder's pages and lengths, their `max_prompt_length` the
    decoder's query length; a state group's table holds its rows (its width: the slots, whatever the length)."""
    out = []
    for g, gm in enumerate(groups):
        rows, lengths, ends = [], [], []
        for ctx, st in zip(batch, states, strict=True):
            tokens = ctx.tokens
            if gm.reads_encoder:  # queries attend the encoder's tokens, all of them already stored
                cached = end = slots = ctx.encoder_length
            else:
                cached, end = tokens.processed_length, tokens.current_position
                slots = (end if gm.lazy else len(tokens)) + spec
            pages = gm.state_slots or required_pages(slots, page_size)
            rows.append((ctx.request_id, st.tables[g], 0 if st.dummy else pages))
            lengths.append(cached)
            ends.append(end)
        cap = None if gm.state_slots else max_cache_length
        tables = assemble_tables(rows, lengths, ends, page_size, nulls[g], cap)
        if gm.reads_encoder:  # the queries are the decoder's: its longest active window
            queries = max((c.tokens.current_position - c.tokens.processed_length for c in batch), default=0)
            tables = dataclasses.replace(tables, max_prompt_length=queries)
        out.append(tables)
    return out
