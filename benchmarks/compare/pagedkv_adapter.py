"""pagedkv's `PagedKVCacheManager` behind the compare driver, and the offline-optimal (Belady) bound.

The manager runs with its page buffers on torch's meta device: only
bookkeeping is measured. The Belady bound is the same manager with an
eviction key that reads the trace's future (`BeladyOracle`): among free
cached pages, evict the one whose next use by a first admission lies
furthest ahead (never-used-again first, deeper chain pages before their
parents on ties).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from pagedkv.core.block_manager import BlockManager
from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.core.hashing import BlockHash
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.kv import KVCacheParams
from pagedkv.workloads.traces import TraceRequest

__all__ = ["PagedKVAdapter", "PagedKVNoQueueAdapter", "BeladyAdapter", "BeladyOracle", "compare_params", "handles"]


def compare_params(page_size: int = 16, **kwargs: Any) -> KVCacheParams:
    """The compared model: 32 layers, 8 KV heads, head_dim 128, bf16, prefix caching on, meta buffers."""
    return KVCacheParams(
        dtype=DType.bfloat16, n_kv_heads=8, head_dim=128, num_layers=32, devices=[DeviceRef.META()],
        page_size=page_size, enable_prefix_caching=True, **kwargs,
    )  # fmt: skip


def handles(reqs: Sequence[TraceRequest]) -> list[TextContext]:
    """Each request's context, created on first use (an adapter's `admit` then takes the same one)."""
    return [req.handle or _new_handle(req) for req in reqs]  # (one pass: the driver tells the queue every step)


def _new_handle(req: TraceRequest) -> TextContext:
    req.handle = TextContext(req.rid, req.live_tokens)
    return req.handle


class PagedKVAdapter:
    """`CacheAdapter` over one `PagedKVCacheManager` replica (`params` from `compare_params`)."""

    def __init__(self, name: str, params: KVCacheParams, num_pages: int, max_num_seqs: int = 256) -> None:
        self.name = name
        self.mgr = PagedKVCacheManager(params, None, num_pages, max_batch_size=max_num_seqs)
        bm = self.mgr._managers[0]
        assert isinstance(bm, BlockManager)  # (the compare workloads are single-group)
        self.bm = bm
        self.page_size = params.page_size

    def new_step(self) -> None:
        pass

    def lookahead(self, waiting: Sequence[TraceRequest]) -> None:
        """The engine scheduler's queue-aware retention: what the next requests will hit is evicted last."""
        self.mgr.expect(handles(waiting))

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        ctx = req.handle
        if ctx is None:
            ctx = req.handle = TextContext(req.rid, req.live_tokens)
        self.mgr.claim(req.rid)
        try:
            self.mgr.alloc(ctx, num_scheduled_tokens=budget)
        except InsufficientBlocksError:
            self.mgr.release(req.rid)
            return None
        n = min(ctx.tokens.active_length, budget)
        if n < ctx.tokens.active_length:
            ctx.tokens.chunk(n)
        return ctx.tokens.processed_length, n

    def extend(self, req: TraceRequest, n: int) -> bool:
        tokens = req.handle.tokens
        if n > 1 or tokens.active_length > 1:  # a prefill chunk (a decode step needs no window change)
            tokens.unchunk()
            if n < tokens.active_length:
                tokens.chunk(n)
        try:
            self.mgr.alloc(req.handle, num_scheduled_tokens=n)
        except InsufficientBlocksError:
            return False
        return True

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        ctxs = []
        for req, _ in batch:
            ctx = req.handle
            ctx.update(req.tokens.item(req.num_tokens - 1))  # ignored mid-prompt (chunked)
            ctxs.append(ctx)
        self.mgr.step([ctxs])

    def free(self, req: TraceRequest, preempted: bool) -> None:
        self.mgr.release(req.rid)
        if preempted:
            req.handle = TextContext(req.rid, req.live_tokens)  # restarts as a prompt of every token so far

    def used_pages(self) -> int:
        return self.bm.pool.num_used


class PagedKVNoQueueAdapter(PagedKVAdapter):
    """pagedkv's manager under a scheduler that never tells it the queue (no `expect`: queue-aware retention off),
    as vLLM's and MAX's managers run: what the manager costs at the hit rates of plain LRU."""

    lookahead = None  # type: ignore[assignment]  # (the driver calls `lookahead` only where it is not None)


class BeladyOracle:
    """Next-use times of every prompt page of a trace, for one manager's hash chain.

    `order` is the sequence of first admissions the future is read from (a
    previous replay's `first_admission_order`): position i is the i-th first
    admission. The key of a free cached page is ``(-next use, -depth)``.
    """

    def __init__(self, adapter: PagedKVAdapter, trace: Sequence[TraceRequest], order: Sequence[int]) -> None:
        self.adapter, self.bm = adapter, adapter.bm
        by_rid = {r.rid: r for r in trace}
        self.uses: dict[BlockHash, list[int]] = {}
        self.depth: dict[BlockHash, int] = {}
        self.prompt_keys: dict[int, list[BlockHash]] = {}
        hasher, ps = self.bm.hasher, adapter.page_size
        for pos, rid in enumerate(order):
            req = by_rid[rid]
            n = (req.prompt_len - 1) // ps
            keys, _ = hasher.extend(req.tokens[: req.prompt_len], 0, n, hasher.root(None)) if n else ([], b"")
            self.prompt_keys[rid] = keys
            for d, key in enumerate(keys):
                self.uses.setdefault(key, []).append(pos)
                self.depth[key] = d
        self.now = 0  # first admissions so far
        pool = self.bm.pool
        pool.keyed_order().key = self.key
        self._pool = pool

    def key(self, page: int) -> tuple[float, int]:
        h = self._pool.block_hash(page)
        uses = self.uses.get(h, ())  # type: ignore[arg-type]
        i = bisect.bisect_left(uses, self.now)
        return (-(uses[i] if i < len(uses) else float("inf")), -self.depth.get(h, 0))  # type: ignore[arg-type]

    def admitted(self, rid: int) -> None:
        """A first admission happened: the pages it needed have new next uses; re-key the free ones."""
        self.now += 1
        pool, order = self._pool, self._pool._order
        assert order is not None
        for key in self.prompt_keys.get(rid, ()):
            page = pool.cached_page(key)
            if page is not None and pool.ref_count(page) == 0 and not pool.is_protected(page):
                order.listed(page, refresh=False)


class BeladyAdapter(PagedKVAdapter):
    """pagedkv's manager evicting by `BeladyOracle` (an offline bound, not a usable policy)."""

    def lookahead(self, waiting: Sequence[TraceRequest]) -> None:
        """Nothing: the oracle's eviction key reads the whole future already."""

    def __init__(self, params: KVCacheParams, num_pages: int, trace: Sequence[TraceRequest], order: Sequence[int],
                 max_num_seqs: int = 256) -> None:  # fmt: skip
        super().__init__("belady", params, num_pages, max_num_seqs)
        self.oracle = BeladyOracle(self, trace, order)

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        got = super().admit(req, budget)
        if got is not None and req.admissions == 0:
            self.oracle.admitted(req.rid)
        return got
