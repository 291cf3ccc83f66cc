"""Copy-on-write reuse of a cached prefix's last, partial page (pure Python + numpy).

A full-page prefix hit stops at page k, the first page whose chained hash is
not cached. The request's tokens of page k may still begin like a cached page
that follows the same parent: the same chain up to page k - 1 (and so the same
`cache_salt`). `PartialPages` finds, among the cached children of that parent,
the one whose first m tokens equal the request's next tokens (longest m,
``1 <= m < page_size``, and never the request's last token). `BlockManager.alloc`
then, after its checks::

    touches the source page          ref + 1: it can be neither evicted nor overwritten
    allocates page k as usual        a fresh private page, uncommitted
    records PageCopy(src, dst, m)    and skips m more tokens (`skip_processing`)

The owner of the page buffers copies the first m token slots of src into dst
(every layer, K and V, every shard, FP8 scales) before the next forward pass:
`BlockManager.take_page_copies()` hands the pending copies over and drops the
source references. `release` drops a copy never taken. When the request fills
page k, the normal commit path hashes it.

The child index maps a parent key to the cached pages that follow it. The
parent key of page i is the prefix-cache key of page i - 1, or ``(root,)``
for page 0 (the root digest folds in the salt). Row p of an int32
``[num_blocks, page_size]`` array holds indexed page p's tokens. Pages enter
at commit (one dict insert) and leave when the pool uncaches them
(`BlockPool.on_uncached`).

`GroupPartialPages` is the same for a `KVCacheCoordinator`, whose cacheable groups each cache page k under
the same chained hash: the child index holds the first cacheable group's pages, and a partial hit copies
the first m tokens of page k in every cacheable group (one `PageCopy` per group, each from the page that
group caches under the source's hash; when some group no longer caches it, there is no partial hit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from pagedkv.core.context import RequestID, TextContext
from pagedkv.core.errors import require as _require
from pagedkv.core.hashing import BlockHash
from pagedkv.core.tables import RequestPages

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.hybrid_state import HybridRequest
    from pagedkv.core.pool import BlockPool

__all__ = [
    "ChildIndex",
    "GroupPartialPages",
    "GroupPartial",
    "PageCopy",
    "Partial",
    "PartialPages",
    "make_group_partial_pages",
    "make_partial_pages",
]

ParentKey = Hashable
"""The prefix-cache key of a page's chain parent, or ``(root digest,)`` for a chain's first page."""
Partial = tuple[int, int] | None
"""A partial hit: (source page, tokens to copy), or None."""
GroupPartial = tuple[list[int], int] | None
"""A coordinator's partial hit: (source page per cacheable group, tokens to copy), or None."""


class PageCopy(NamedTuple):
    """Copy token slots ``[0, num_tokens)`` of page `src` into page `dst` (all layers, K and V)."""

    src: int
    dst: int
    num_tokens: int


class ChildIndex:
    """Cached pages by chain parent, with their tokens. Holds no references."""

    def __init__(self, num_blocks: int, page_size: int) -> None:
        self.page_size = page_size
        self._tokens = np.zeros((num_blocks, page_size), dtype=np.int32)  # [pages, page_size]
        self._parent: list[ParentKey | None] = [None] * num_blocks  # None: not indexed
        self._children: dict[ParentKey, dict[int, None]] = {}  # parent -> pages (an insertion-ordered set)

    def __len__(self) -> int:
        return sum(len(c) for c in self._children.values())

    def add(self, parent: ParentKey, page: int, tokens: np.ndarray) -> None:
        """Index cached `page` (its `page_size` tokens) under `parent`; no-op if it is indexed."""
        if self._parent[page] is not None:
            return
        self._parent[page] = parent
        self._tokens[page] = tokens
        children = self._children.get(parent)
        if children is None:
            self._children[parent] = {page: None}
        else:
            children[page] = None

    def remove(self, page: int) -> None:
        """Forget `page` (the pool uncached it); no-op if it is not indexed."""
        parent = self._parent[page]
        if parent is None:
            return
        self._parent[page] = None
        children = self._children[parent]
        del children[page]
        if not children:
            del self._children[parent]

    def longest_match(self, parent: ParentKey, want: np.ndarray) -> tuple[int, int] | None:
        """(page, m): the child of `parent` whose first m tokens equal ``want[:m]``, m largest
        (ties: the earliest indexed), or None when no child matches a token. No side effects."""
        children = self._children.get(parent)
        if not children or not len(want):
            return None
        pages = np.fromiter(children, dtype=np.intp, count=len(children))  # [n]
        eq = self._tokens[pages, : len(want)] == want  # [n, len(want)]
        match = np.where(eq.all(axis=1), len(want), eq.argmin(axis=1))  # [n] leading equal tokens
        best = int(match.argmax())
        return (int(pages[best]), int(match[best])) if match[best] else None

    def parent_of(self, page: int) -> ParentKey | None:
        """The parent key `page` is indexed under, or None."""
        return self._parent[page]

    def pages(self) -> set[int]:
        """Every indexed page."""
        return {p for children in self._children.values() for p in children}


class PartialPages:
    """The child index and the pending copies of one `BlockManager` (see the module docstring)."""

    def __init__(self, pool: BlockPool, page_size: int, root: Callable[[str | None], bytes]) -> None:
        self.pool = pool
        self.page_size = page_size
        self._root = root
        self.index = ChildIndex(pool.num_blocks, page_size)
        self.pending: dict[RequestID, PageCopy] = {}
        pool.on_uncached.append(self.index.remove)

    def _parent_key(self, keys: Sequence[BlockHash], i: int, ctx: TextContext) -> ParentKey:
        return keys[i - 1] if i else (self._root(ctx.cache_salt),)

    def find(self, ctx: TextContext, keys: Sequence[BlockHash], first: int, hits: Sequence[int], need: int) -> Partial:
        """(source page, m) for the request's page ``first + len(hits)``, or None. No side effects.

        `keys`: the request's page keys, at least up to that page's parent.
        `need`: new pages the alloc takes. A free source leaves the free count
        when touched; where that extra page is not there, the partial hit is
        skipped rather than failing an alloc that fits without it.
        """
        ps, tokens = self.page_size, ctx.tokens
        k = first + len(hits)
        start = k * ps
        limit = min(ps - 1, tokens.current_position - 1 - start)  # the last (window) token is computed
        if limit < 1:
            return None
        found = self.index.longest_match(self._parent_key(keys, k, ctx), tokens.all[start : start + limit])
        if found is None:
            return None
        pool = self.pool
        if pool.ref_count(found[0]) == 0 and need + 1 > pool.num_free - pool.count_unreferenced(hits):
            return None
        return found

    def record(self, st: RequestPages, ctx: TextContext, src: int, num_tokens: int) -> int:
        """After `alloc` touched `src` and appended page ``st.committed``: queue the copy, skip the
        tokens; returns how many."""
        self.pending[ctx.request_id] = PageCopy(src, int(st.pages[st.committed]), num_tokens)
        ctx.tokens.skip_processing(num_tokens)
        return num_tokens

    def committed(self, st: RequestPages, ctx: TextContext, first: int, stop: int) -> None:
        """Index the request's pages [first, stop), just committed (merged ones are indexed already)."""
        ps, pages, hashes, add = self.page_size, st.pages, st.hashes, self.index.add
        tokens = ctx.tokens._array  # the buffer itself: `all` builds a read-only view per call
        for i in range(first, stop):
            add(hashes[i - 1] if i else (self._root(ctx.cache_salt),), int(pages[i]), tokens[i * ps : (i + 1) * ps])

    def take(self) -> list[PageCopy]:
        """Every pending copy, oldest first; their source references are dropped."""
        copies = list(self.pending.values())
        self.pending.clear()
        self.pool.free([c.src for c in copies])
        return copies

    def drop(self, request_id: RequestID) -> None:
        """Forget `request_id`'s pending copy, if any, and its source reference."""
        copy = self.pending.pop(request_id, None)
        if copy is not None:
            self.pool.free((copy.src,))

    def check(self, reqs: Mapping[RequestID, RequestPages], holders: Counter[int]) -> None:
        """Raise `IntegrityError` unless each pending copy targets its request's page ``committed``
        (uncommitted) from a cached source, and the index holds exactly the cached, written pages. Adds the
        source references to `holders`."""
        pool, ps = self.pool, self.page_size
        for rid, (src, dst, n) in self.pending.items():
            st = reqs.get(rid)
            _require(st is not None, f"pending page copy of request {rid!r}, which is not claimed")
            assert st is not None
            where = f"request {rid!r} pending copy {src} -> {dst} of {n} tokens"
            _require(1 <= n < ps, f"{where}: needs 1 <= tokens < page_size={ps}")
            _require(st.committed < st.num_pages and int(st.pages[st.committed]) == dst,
                     f"{where}: dst is not the request's page {st.committed} (its first uncommitted)")  # fmt: skip
            _require(pool.block_hash(dst) is None, f"{where}: dst is committed")
            _require(pool.block_hash(src) is not None, f"{where}: src is not cached")
            holders[src] += 1
        cached = {p for p in range(pool.num_blocks) if pool.block_hash(p) is not None}
        for st in reqs.values():  # committed at alloc, not written yet: indexed at their step (commit_on_alloc)
            if st.unwritten >= 0:
                cached.difference_update(st.pages[st.unwritten : st.committed].tolist())
        indexed = self.index.pages()
        _require(indexed == cached, f"child index pages {sorted(indexed ^ cached)} disagree with the prefix cache")

    def state(self) -> tuple[Any, ...]:
        """Pending copies and index entries, for no-trace comparisons in tests."""
        entries = {p: (self.index.parent_of(p), self.index._tokens[p].tolist()) for p in sorted(self.index.pages())}
        return sorted(self.pending.items(), key=repr), entries


def make_partial_pages(
    enabled: bool, pool: BlockPool, page_size: int, root: Callable[[str | None], bytes]
) -> PartialPages | None:
    """`PartialPages` for a `BlockManager` built with ``partial_page_reuse=enabled`` (None when off).

    Raises TypeError unless `enabled` is a bool, ValueError when it is True without prefix caching
    or on a pool shared by several groups (a `KVCacheCoordinator` serves those: `GroupPartialPages`)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"partial_page_reuse={enabled!r} must be a bool")
    if not enabled:
        return None
    if not pool.enable_prefix_caching:
        raise ValueError("partial_page_reuse=True needs enable_prefix_caching=True")
    if pool.num_groups != 1:
        raise ValueError(f"partial_page_reuse=True supports one KV cache group, not {pool.num_groups}")
    return PartialPages(pool, page_size, root)


class GroupPartialPages:
    """The child index and pending copies of one `KVCacheCoordinator` (see the module docstring): the index
    holds the pages of group ``groups[0]``; a hit copies page k's first m tokens in each of `groups`."""

    def __init__(
        self, pool: BlockPool, page_size: int, root: Callable[[str | None], bytes], groups: Sequence[int]
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.groups = list(groups)
        self._root = root
        self.index = ChildIndex(pool.num_blocks, page_size)
        self.pending: dict[RequestID, list[PageCopy]] = {}
        pool.on_uncached.append(self.index.remove)

    def find(self, ctx: TextContext, keys: Sequence[BlockHash], k: int) -> GroupPartial:
        """(source page per group, m) for the request's page `k` (the first after its hit), or None. No side
        effects. `keys`: the request's page keys, at least up to page k's parent."""
        ps, tokens, pool = self.page_size, ctx.tokens, self.pool
        start = k * ps
        limit = min(ps - 1, tokens.current_position - 1 - start)  # the last (window) token is computed
        if limit < 1:
            return None
        parent = keys[k - 1] if k else (self._root(ctx.cache_salt),)
        found = self.index.longest_match(parent, tokens.all[start : start + limit])
        if found is None:
            return None
        key = pool.block_hash(found[0])
        assert key is not None
        sources = [found[0] if g == self.groups[0] else pool.cached_page(key, g) for g in self.groups]
        return None if None in sources else (sources, found[1])  # type: ignore[return-value]

    def extra_pages(self, found: GroupPartial) -> int:
        """Unprotected free pages that touching `found`'s sources takes out of the free count."""
        pool = self.pool
        return sum(1 for p in found[0] if pool.ref_count(p) == 0 and not pool.is_protected(p)) if found else 0

    def skip(self, ctx: TextContext, found: tuple[list[int], int]) -> int:
        """Hold the sources (neither evicted nor overwritten) and skip the tokens they hold; returns how many."""
        self.pool.touch(found[0])
        ctx.tokens.skip_processing(found[1])
        return found[1]

    def record(self, st: HybridRequest, request_id: RequestID, found: tuple[list[int], int]) -> None:
        """After `skip` and the alloc's new pages: queue the copies into page ``st.committed`` of each group."""
        k, (sources, m) = st.committed, found
        self.pending[request_id] = [PageCopy(src, int(st.tables[g].pages[k]), m)
                                    for g, src in zip(self.groups, sources, strict=True)]  # fmt: skip

    def committed(self, st: HybridRequest, ctx: TextContext, lo: int, hi: int) -> None:
        """Index the request's pages [lo, hi) of ``groups[0]``, just committed and written."""
        ps, pages, hashes, add = self.page_size, st.tables[self.groups[0]].pages, st.hashes, self.index.add
        tokens = ctx.tokens._array  # the buffer itself: `all` builds a read-only view per call
        for i in range(lo, hi):
            add(hashes[i - 1] if i else (self._root(ctx.cache_salt),), int(pages[i]), tokens[i * ps : (i + 1) * ps])

    def take(self) -> list[PageCopy]:
        """Every pending copy, oldest request first; their source references are dropped."""
        copies = [c for request in self.pending.values() for c in request]
        self.pending.clear()
        self.pool.free([c.src for c in copies])
        return copies

    def drop(self, request_id: RequestID) -> None:
        """Forget `request_id`'s pending copies, if any, and their source references."""
        copies = self.pending.pop(request_id, None)
        if copies is not None:
            self.pool.free([c.src for c in copies])

    def check(self, reqs: Mapping[RequestID, HybridRequest]) -> Counter[int]:
        """Raise `IntegrityError` unless each pending copy targets its request's page ``committed`` (uncommitted)
        in its group from a page that group caches, and the index holds exactly the written cached pages of
        ``groups[0]``. Returns the sources' references."""
        pool, ps, lead, holders = self.pool, self.page_size, self.groups[0], Counter[int]()
        for rid, copies in self.pending.items():
            st = reqs.get(rid)
            _require(st is not None, f"pending page copy of request {rid!r}, which is not claimed")
            assert st is not None
            _require(len(copies) == len(self.groups), f"request {rid!r}: {len(copies)} pending copies, not one a group")
            for g, (src, dst, n) in zip(self.groups, copies, strict=True):
                table, where = st.tables[g], f"request {rid!r} group {g} pending copy {src} -> {dst} of {n} tokens"
                _require(1 <= n < ps, f"{where}: needs 1 <= tokens < page_size={ps}")
                _require(st.committed < table.num_pages and int(table.pages[st.committed]) == dst,
                         f"{where}: dst is not the request's page {st.committed} (its first uncommitted)")  # fmt: skip
                _require(pool.block_hash(dst) is None, f"{where}: dst is committed")
                _require(
                    pool.block_hash(src) is not None and pool.group_of(src) == g, f"{where}: src is not cached there"
                )
                holders[src] += 1
        cached = {p for p in range(pool.num_blocks) if pool.block_hash(p) is not None and pool.group_of(p) == lead}
        for st in reqs.values():  # committed at alloc, not written yet: indexed at their step (commit_on_alloc)
            if st.unwritten >= 0:
                table = st.tables[lead]
                cached.difference_update(table.pages[st.unwritten : min(st.committed, table.num_pages)].tolist())
        indexed = self.index.pages()
        _require(indexed == cached, f"child index pages {sorted(indexed ^ cached)} disagree with the prefix cache")
        return holders

    def state(self) -> tuple[Any, ...]:
        """Pending copies and index entries, for no-trace comparisons in tests."""
        entries = {p: (self.index.parent_of(p), self.index._tokens[p].tolist()) for p in sorted(self.index.pages())}
        return sorted(self.pending.items(), key=repr), entries


def make_group_partial_pages(
    enabled: bool,
    pool: BlockPool,
    page_size: int,
    root: Callable[[str | None], bytes],
    groups: Sequence[int],
    stateful: bool,
) -> GroupPartialPages | None:
    """`GroupPartialPages` for a `KVCacheCoordinator` built with ``partial_page_reuse=enabled`` over cacheable
    `groups` (None when off). ValueError when it is True without prefix caching or cacheable groups, or for a
    model with recurrent state (`stateful`: a hit resumes from a state checkpoint, which holds no partial page)."""
    if not enabled:
        return None
    if not pool.enable_prefix_caching or not groups:
        raise ValueError("partial_page_reuse=True needs enable_prefix_caching=True and a prefix-cached group")
    if stateful:
        raise ValueError("partial_page_reuse=True does not support models with recurrent state (their hits resume "
                         "from a state checkpoint, which holds no partial page)")  # fmt: skip
    return GroupPartialPages(pool, page_size, root, groups)
