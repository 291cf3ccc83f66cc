"""``"lru"`` (the default): the least recently freed or reused free page goes first."""

from __future__ import annotations

from pagedkv.core.pool.policies.base import EvictionPolicy

__all__ = ["LruPolicy"]


class LruPolicy(EvictionPolicy):
    """LRU: one list, evicted from its head (the base class's defaults). The pool frees a request's pages
    tail first, so the deepest pages of a prefix go before its head."""

    name = "lru"
