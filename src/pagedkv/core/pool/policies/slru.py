"""``"slru"``: segmented LRU, pages never reused since they were cached go before those that served a hit."""

from __future__ import annotations

from typing import Any

from pagedkv.core.pool.policies.base import EvictionPolicy

__all__ = ["SlruPolicy"]


class SlruPolicy(EvictionPolicy):
    """Segmented LRU: freed pages wait in probation until they serve a hit; probation is evicted first, each
    segment in LRU order. Keyed, the same order: ``(reused, tick)``."""

    name = "slru"
    segmented = True

    def order_key(self, page: int, tick: int, reused: int) -> tuple[Any, ...]:
        return (reused, tick)
