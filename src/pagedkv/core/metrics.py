"""`KVCacheMetrics`: counters of one replica (or a sum over replicas), MAX's names."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KVCacheMetrics"]


@dataclass
class KVCacheMetrics:
    """Cache counters since the last `reset_metrics`, plus a snapshot of page usage.

    Attributes:
        input_tokens: tokens that had to be computed: the active tokens at every
            `alloc` (decode steps count one each), after prefix-cache hits.
        cache_tokens: tokens served from the cache instead of computed.
        evictions: cached pages whose hash was dropped to make room.
        used_pages / total_pages: device pages running requests hold and in the pool (snapshot): an idle
            manager uses 0, whatever it caches.
        cached_pages: device pages holding a prefix-cache hash (snapshot).
        checkpoint_pages: device pages that hold only recurrent-state checkpoints (their runs of pages, and
            tail pages no running request holds; snapshot). Evictable like cached pages: not used.
    """

    input_tokens: int = 0
    cache_tokens: int = 0
    evictions: int = 0
    used_pages: int = 0
    total_pages: int = 0
    cached_pages: int = 0
    checkpoint_pages: int = 0

    @classmethod
    def of(
        cls,
        pool: Any,
        input_tokens: int,
        cache_tokens: int,
        evictions_at_reset: int,
        checkpoints: tuple[int, int] = (0, 0),
    ) -> KVCacheMetrics:
        """The counters of a manager over `pool` (a `BlockPool`), with its page usage now; `checkpoints`: the
        pages the pool counts as referenced that only checkpoints hold, and every page checkpoints take
        (`StateCheckpoints.page_usage`)."""
        return cls(
            input_tokens=input_tokens,
            cache_tokens=cache_tokens,
            evictions=pool.num_evictions - evictions_at_reset,
            used_pages=pool.num_used - checkpoints[0],
            total_pages=pool.num_blocks,
            cached_pages=pool.num_cached,
            checkpoint_pages=checkpoints[1],
        )

    @property
    def prompt_tokens(self) -> int:
        """Tokens asked for: computed plus served from the cache."""
        return self.input_tokens + self.cache_tokens

    @property
    def cache_hit_rate(self) -> float:
        """`cache_tokens / prompt_tokens`, 0.0 before any token."""
        total = self.prompt_tokens
        return self.cache_tokens / total if total else 0.0

    @property
    def used_pages_pct(self) -> float:
        """`used_pages / total_pages`, 0.0 for an empty pool."""
        return self.used_pages / self.total_pages if self.total_pages else 0.0

    def __add__(self, other: KVCacheMetrics) -> KVCacheMetrics:
        if not isinstance(other, KVCacheMetrics):
            return NotImplemented
        return KVCacheMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
