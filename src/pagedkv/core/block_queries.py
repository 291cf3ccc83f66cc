"""`BlockManagerQueries`: the read-mostly side of `BlockManager` (tables, metrics, pinned prefixes)."""

from __future__ import annotations

from typing import Any

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.context import RequestID, Retention, TextContext, as_token_array
from pagedkv.core.hashing import PrefixHasher, check_salt
from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.core.tables import BatchTables, RequestPages, build_tables

__all__ = ["BlockManagerQueries"]


class BlockManagerQueries:
    """Mixed into `BlockManager`, which owns the state read here."""

    pool: BlockPool
    page_size: int
    num_speculative_tokens: int
    hasher: PrefixHasher
    _reqs: dict[RequestID, RequestPages]
    _input_tokens: int
    _cache_tokens: int
    _evictions_at_reset: int

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

    # ------------------------------------------------------------------ queries
    def get_req_blocks(self, request_id: RequestID) -> list[int]:
        """The page ids of `request_id` in logical order (``[null]`` for a dummy)."""
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
        pool = self.pool
        return KVCacheMetrics(
            input_tokens=self._input_tokens,
            cache_tokens=self._cache_tokens,
            evictions=pool.num_evictions - self._evictions_at_reset,
            used_pages=pool.num_used,
            total_pages=pool.num_blocks,
            cached_pages=pool.num_cached,
        )

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
