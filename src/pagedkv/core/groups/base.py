"""`GroupManager`: the page policy of one KV cache group, and what one allocation asks of it.

The coordinator loops over its groups and asks each the same questions; each type answers for itself:

- `pages_to_add(have, span)`: how many pages the table takes for the positions `span` computes;
- `drop_range(dropped, floor, processed, have)`: which leading pages go back to the pool before it;
- `hit_range(pages)`: which pages a prefix hit of `pages` pages needs cached;
- `commit(pool, table, hashes, lo, hi)`: how its written full pages enter the prefix cache.

Positions are absolute token positions; `first_needed(q)` is the earliest key position a query at q (or any
later one) can still attend to, so every page entirely before it can return to the pool (the table keeps
the null page in its place). `step_pages` is what one step holds in a group (`min_request_pages`).
A new attention kind is a spec, a subclass here and a mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pagedkv.specs import KVCacheSpec

if TYPE_CHECKING:  # (types only: the pool lives above the groups)
    from pagedkv.core.context import Retention
    from pagedkv.core.hashing import BlockHash
    from pagedkv.core.pool import BlockPool
    from pagedkv.core.tables import RequestPages

__all__ = ["FAR", "GroupManager", "StepSpan"]

FAR = 1 << 62  # a position no request reaches


class StepSpan(NamedTuple):
    """What one `alloc` computes, the same for every group: positions [processed, end) of a context of
    `length` tokens, with `spec` draft slots after it, over an encoder input of `encoder_length` tokens."""

    processed: int
    end: int
    length: int
    spec: int
    encoder_length: int


class GroupManager:
    """The policy of one group's pages; the defaults are full attention's (every page stays, hits are any
    cached prefix). Subclasses override the hooks their type changes."""

    lazy = False  # window types allocate only up to the active window, not the whole prompt
    cacheable = True  # takes part in prefix caching
    holds_tokens = True  # one slot per decoder token (not the encoder's tokens, not recurrent state rows)
    reads_encoder = False  # pages hold the encoder's tokens, written once (cross-attention)
    state_slots = 0  # > 0: pages hold recurrent states, this many per request whatever its length (`MambaManager`)
    kind = "full_attention"  # vLLM's `KVCacheSpecKind` of the group (KV events carry it)

    def __init__(self, group: int, page_size: int) -> None:
        self.group = group
        self.page_size = page_size

    @classmethod
    def from_spec(cls, group: int, spec: KVCacheSpec) -> GroupManager:
        """The manager of group `group`, whose layers all have `spec` (`spec.block_size` is the page size)."""
        return cls(group, spec.block_size)

    # ----------------------------------------------------------------- what a query reads
    def first_needed(self, query_position: int) -> int:
        """Earliest key position a query at `query_position` or later attends to."""
        return 0

    def kept_pages(self) -> int:
        """Leading pages never dropped (attention sinks)."""
        return 0

    def droppable_pages(self, query_position: int) -> int:
        """Leading pages no query from `query_position` on reads (kept pages excluded from the drop)."""
        return self.first_needed(query_position) // self.page_size

    def drop_threshold(self, dropped: int) -> int:
        """Smallest query position at which page `dropped` (the next one) becomes droppable."""
        return FAR

    def hit_range(self, hit_pages: int) -> tuple[int, int]:
        """Pages [start, hit_pages) that must be cached for a prefix hit of `hit_pages` pages
        (the kept sink pages as well, see `kept_pages`)."""
        return 0, hit_pages

    # ----------------------------------------------------------------- what an allocation changes
    def pages_to_add(self, have: int, span: StepSpan) -> int:
        """Pages the table, holding `have` (hits included), takes for `span`: every token's and draft slot's."""
        return max(0, -(-(span.length + span.spec) // self.page_size) - have)

    def drop_range(self, dropped: int, floor: int, processed: int, have: int) -> tuple[int, int]:
        """Table entries [lo, hi) that return to the pool before a step from `processed`, for a table of `have`
        pages whose first `dropped` are dropped already and whose first `floor` are shared (they stay).
        ``hi`` is the new dropped count (it may pass `have`). None for a group that keeps every page."""
        return 0, 0

    def commit(
        self, pool: BlockPool, table: RequestPages, hashes: list[BlockHash], lo: int, hi: int,
        retention: Retention | None = None,
    ) -> int:  # fmt: skip
        """Cache the table's written pages [lo, hi) under ``hashes[lo:hi]`` (null entries skipped), each chained
        to the page before it (the eviction order's prefix tree). A page whose hash is cached already is swapped
        for that copy. With `retention`, the committed pages take at least its priority. Returns one past the
        last swapped index (0: none). A group that is not `cacheable` commits nothing (cross-attention's pages
        belong to one request; a state is cached as a checkpoint, not as pages)."""
        null, shared = pool.null_block, 0
        hi = min(hi, table.num_pages)
        if hi <= lo or not self.cacheable:
            return 0
        pages = [int(table.pages[lo])] if hi == lo + 1 else table.pages[lo:hi].tolist()
        parent = int(table.pages[lo - 1]) if lo else -1
        parent = -1 if parent == null else parent  # (a window group's dropped entry chains to nothing)
        for i, page in enumerate(pages, lo):
            if page == null:  # (a dropped window page: the next one starts a chain of its own)
                parent = -1
                continue
            used = pool.commit(page, hashes[i], self.group, -1 if parent == null else parent)
            if used != page:  # merged into a cached copy: this prefix is shared
                shared = i + 1
                table.pages[i] = used
            parent = used
        if retention is not None:
            pool.retain([p for p in table.pages[lo:hi].tolist() if p != null], retention.priority,
                        retention.duration_s)  # fmt: skip
        return shared

    # ----------------------------------------------------------------- capacity
    def step_pages(self, start: int, end: int, length: int, spec: int = 0, encoder_length: int = 0) -> int:
        """Pages this group holds during a step that processes positions [start, end) of a context of
        `length` tokens with `spec` speculative slots, once the step's drops are done (drops happen at
        `start`; the pages of [first_needed(start), end + spec) stay). A full group holds every
        token's page (`length`, not `end`: the whole context is allocated at once); a window group
        only the window of this step; cross-attention the encoder's `encoder_length` tokens."""
        top = end if self.lazy else length
        return -(-(top + spec) // self.page_size) - (self.droppable_pages(start) - self.kept_pages())

    def periodicity(self) -> tuple[int, int]:
        """(warmup, period): ``step_pages(q, q + 1, ...)`` for q >= warmup repeats every `period` positions."""
        return 0, 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group})"
