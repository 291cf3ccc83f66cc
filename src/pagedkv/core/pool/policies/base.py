"""`EvictionPolicy`: what a page pool asks its eviction policy, with the defaults of plain LRU.

A `BlockPool` keeps its free cached pages in lists, each oldest first: *probation* (pages never reused since
they were cached, under a `segmented` policy), *LRU* (the others) and *protected* (pinned pages, evicted last
whatever the policy). It orders their eviction in one of two ways:

- **List order** (the default): victims come from the list heads, probation first. A policy that overrides
  `from_probation` (which list goes next) or `evicted` (which page went) is asked page by page; one that
  overrides neither lets the pool take runs of pages at once.
- **Keyed order**: a heap over `order_key`, smallest first. The pool builds it at once for a `keyed` policy,
  and for any policy when a retention priority is set or with ``evict_leaves_first``; while it exists the
  pool reports hits (`hit`), cachings (`cached`), pages losing their hash (`forgotten`) and the heap's
  victims (`chosen`).

Retention priorities, queue-aware retention (`BlockPool.want`) and leaves first come before the policy's
order. Hooks keep the policy's own state only and never change the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pagedkv.core.hashing import BlockHash

__all__ = ["EvictionPolicy"]


class EvictionPolicy:
    """The eviction order of one pool's free cached pages (see the module docstring). Every hook has a
    default (plain LRU's), so a policy overrides only what it changes. The pool builds one object per
    pool from the policy's registered `name` (``EvictionPolicy(num_blocks)``) and keeps it for its life.

    Class attributes: `name` (``eviction_policy=`` selects it), `segmented` (freed pages that never served
    a hit since they were cached go to probation, evicted before the LRU list), `keyed` (order by
    `order_key` from the start, not by list heads). Derived for each subclass: `page_by_page`, True
    when it overrides `from_probation` or `evicted`; `listens`, the keyed-order hooks it overrides (the
    pool skips the others).
    """

    name: ClassVar[str] = ""
    segmented: ClassVar[bool] = False
    keyed: ClassVar[bool] = False
    page_by_page: ClassVar[bool] = False
    listens: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = EvictionPolicy
        cls.page_by_page = cls.from_probation is not base.from_probation or cls.evicted is not base.evicted
        cls.listens = frozenset(
            h for h in ("hit", "cached", "forgotten", "chosen") if getattr(cls, h) is not getattr(base, h)
        )

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks  # pages of the pool (ids 0 .. num_blocks - 1)

    # ------------------------------------------------------------------ list order
    def from_probation(self, n_probation: int, n_lru: int) -> bool:
        """Whether the next victim is the head of probation (True) or of the LRU list, given how many free
        pages each holds (at least one of them is not empty). Default: probation while it holds any."""
        return n_probation > 0

    def evicted(self, block_hash: BlockHash, from_probation: bool) -> None:
        """The pool evicted the page cached under `block_hash` from the head of probation (True) or of the
        LRU list, in list order. Default: nothing."""

    def missed(self, keys: Sequence[BlockHash]) -> None:
        """A prefix lookup wanted the pages of `keys` and found none of them cached (`BlockPool.note_misses`,
        under either order). Default: nothing."""

    # ------------------------------------------------------------------ keyed order
    def order_key(self, page: int, tick: int, reused: int) -> tuple[Any, ...]:
        """The heap key of free cached `page` (smaller is evicted first): `tick` counts listings, so a larger
        one was freed or refreshed more recently; `reused` is 1 once the page served a hit since it was
        cached. Asked each time the page enters or moves within its list. Default: ``(tick,)``, LRU."""
        return (tick,)

    def hit(self, page: int) -> None:
        """Cached `page` served a prefix hit or a merge (keyed order only). Default: nothing."""

    def cached(self, page: int) -> None:
        """`page` was just cached under a new hash (keyed order only). Default: nothing."""

    def forgotten(self, page: int) -> None:
        """`page` is about to lose its hash: evicted or uncached (keyed order only). Default: nothing."""

    def chosen(self, page: int, key: tuple[Any, ...]) -> None:
        """The keyed order picked `page`, ranked `key` (its `order_key`), as the next victim. Default: nothing."""
