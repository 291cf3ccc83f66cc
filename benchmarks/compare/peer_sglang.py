"""SGLang 0.5.23's real `RadixCache` as a `CacheAdapter`, with its real paged allocator and row pool.

On the measured path: `RadixCache.match_prefix` / `lock` / `checkpoint` / `evict` /
`free_kv_row` / `unlock`, `PagedTokenToKVPoolAllocator.alloc_extend` / `alloc_decode`
(its CPU "naive" torch path), `ReqToTokenPool` rows and a real `ReqKvInfo` per request.
The lifecycle is SGLang's scheduler's (its `schedule_batch` / `RadixCache` documentation), inside the shared loop:

- admission: ``match_prefix(fill_ids[:-1])`` + ``lock``; the matched indices go into a
  fresh `ReqToTokenPool` row;
- each step: **one** batched ``alloc_decode`` and **one** batched ``alloc_extend`` (in
  `advance`), after ``evict(shortfall)`` when free pages are short;
- ``checkpoint(req, up_to=chunk end)`` after every prefill chunk;
- finish: ``checkpoint(up_to=kv_committed_len)`` + ``free_kv_row`` + ``unlock`` + row free;
  preemption: the same without the checkpoint.

The protocol asks for room one request at a time while SGLang allocates per step, so
`admit` / `extend` only reserve pages: a request fits when the pages reserved this step
plus its own are at most free + evictable pages (exact: eviction can free every unlocked
page, and nothing is allocated or freed between the checks and `advance`). Tree insertion
happens after the forward pass, so unlike vLLM a request cannot hit a prefix that another
request is prefilling in the same step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.compare.peers import import_peer
from pagedkv.workloads.traces import TraceRequest

__all__ = ["SglangAdapter", "sglang_version"]


def _sglang() -> SimpleNamespace:
    """SGLang's classes used here (raises PeerUnavailable when SGLang is missing)."""

    def load() -> SimpleNamespace:
        import torch
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        return SimpleNamespace(
            torch=torch,
            ReqKvInfo=ReqKvInfo,
            PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
            EvictParams=EvictParams,
            MatchPrefixParams=MatchPrefixParams,
            CacheInitParams=CacheInitParams,
            ReqToTokenPool=ReqToTokenPool,
            RadixCache=RadixCache,
            RadixKey=RadixKey,
        )

    return import_peer("SGLang", load)


def sglang_version() -> str:
    """The installed SGLang version (raises PeerUnavailable when SGLang is missing)."""
    return str(import_peer("SGLang", lambda: __import__("sglang").__version__))


class _Req:
    """The 9 attributes `RadixCache.checkpoint` reads off an SGLang `Req`, plus this adapter's state."""

    __slots__ = ("rid", "kv", "origin_input_ids", "full_untruncated_fill_ids", "lock", "last_node", "extra_key",
                 "cache_salt", "priority", "reserved", "decoding")  # fmt: skip

    def __init__(self, rid: int, tokens: array, prompt_len: int, kv: Any) -> None:
        self.rid = str(rid)
        self.kv = kv
        self.full_untruncated_fill_ids = tokens  # the whole trace; the tree only reads [:computed]
        self.origin_input_ids = tokens[:prompt_len]
        self.lock: Any = None
        self.last_node: Any = None
        self.extra_key = self.cache_salt = None
        self.priority = 0
        self.reserved = 0  # pages reserved this step, allocated in advance()
        self.decoding = False  # prefill done: the next step is a decode


class SglangAdapter:
    """SGLang's `RadixCache` behind the `CacheAdapter` protocol.

    `num_pages` usable pages of `page_size` tokens (the allocator gets
    ``num_pages * page_size`` tokens; its page 0 is reserved on top, as vLLM's block 0).
    ``used_pages`` counts pages pinned by running requests (locked in the tree or in
    their own rows); unlocked tree pages are evictable and not counted.
    """

    name = "sglang"

    def __init__(
        self, num_pages: int, page_size: int = 16, max_num_seqs: int = 256, max_model_len: int = 65536
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        s = self._s = _sglang()
        torch = self._torch = s.torch
        self.num_pages, self.page_size = num_pages, page_size
        self.pool: Any = s.ReqToTokenPool(max_num_seqs + 8, max_model_len, "cpu", False)
        self.allocator: Any = s.PagedTokenToKVPoolAllocator(
            num_pages * page_size, page_size, torch.bfloat16, "cpu", None, need_sort=False
        )
        params = s.CacheInitParams(
            disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=page_size
        )
        self.tree: Any = s.RadixCache(params)
        self._rows = self.pool.req_to_token  # int32 [max_num_seqs + 9, max_model_len]
        self._reserved = 0  # pages reserved by admit/extend since the last advance

    # -- room ----------------------------------------------------------------------------------
    def _pages(self, start: int, n: int) -> int:
        """New pages a row holding `start` tokens needs for `n` more."""
        p = self.page_size
        return -(-(start + n) // p) - -(-start // p)

    def _fits(self, pages: int) -> bool:
        room = (self.allocator.available_size() + self.tree.evictable_size()) // self.page_size
        return self._reserved + pages <= room

    # -- protocol ------------------------------------------------------------------------------
    def new_step(self) -> None:
        pass  # SGLang has no per-step hook in the tree or the allocator

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        s, rec = self._s, req.handle
        if rec is None:
            tokens = array("q")
            tokens.frombytes(np.ascontiguousarray(req.tokens, dtype=np.int64).tobytes())
            rec = req.handle = _Req(req.rid, tokens, req.prompt_len, s.ReqKvInfo())
        key = s.RadixKey(rec.full_untruncated_fill_ids, limit=req.num_tokens - 1)  # fill_ids[:-1]
        match = self.tree.match_prefix(s.MatchPrefixParams(key=key))
        hit, node = match.device_prefix_len, match.last_device_node
        lock = self.tree.lock(node)
        n = min(req.num_tokens - hit, budget)
        pages = self._pages(hit, n)
        if not self._fits(pages) or self.pool.available_size() == 0:
            self.tree.unlock(lock)
            return None
        (row,) = self.pool.alloc([rec])
        if hit:
            self._rows[row, :hit] = self.tree.path_device_indices(node)[:hit]
        kv = rec.kv
        kv.cache_protected_len = kv.kv_allocated_len = kv.kv_committed_len = hit
        rec.lock, rec.last_node, rec.decoding = lock, node, False
        rec.reserved = pages
        self._reserved += pages
        return hit, n

    def extend(self, req: TraceRequest, n: int) -> bool:
        rec = req.handle
        pages = self._pages(rec.kv.kv_allocated_len, n)
        if not self._fits(pages):
            return False
        rec.reserved += pages
        self._reserved += pages
        return True

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        shortfall = self._reserved * self.page_size - self.allocator.available_size()
        if shortfall > 0:
            self.tree.evict(self._s.EvictParams(num_tokens=shortfall))
        decode = [req.handle for req, _ in batch if req.handle.decoding]
        extend = [(req.handle, n) for req, n in batch if not req.handle.decoding]
        if decode:
            self._alloc_decode(decode)
        if extend:
            self._alloc_extend(extend)
        for req, _ in batch:
            req.handle.reserved = 0
        self._reserved = 0
        for rec, _ in extend:  # SGLang's checkpoint_kv_cache after each prefill chunk
            self.tree.checkpoint(rec, up_to=rec.kv.kv_committed_len)
        for req, _ in batch:
            req.handle.decoding = req.num_computed == req.num_tokens - 1

    def _alloc_decode(self, recs: list[_Req]) -> None:
        torch = self._torch
        rows = torch.tensor([r.kv.req_pool_idx for r in recs], dtype=torch.int64)
        lens = torch.tensor([r.kv.kv_allocated_len for r in recs], dtype=torch.int64)
        last_loc = self._rows[rows, lens - 1].to(torch.int64)
        out = self.allocator.alloc_decode(lens + 1, lens + 1, last_loc)
        assert out is not None, "decode allocation failed after the room check"
        self._rows[rows, lens] = out.to(torch.int32)
        for r in recs:
            r.kv.kv_allocated_len += 1
            r.kv.kv_committed_len += 1

    def _alloc_extend(self, entries: list[tuple[_Req, int]]) -> None:
        torch = self._torch
        rows = torch.tensor([r.kv.req_pool_idx for r, _ in entries], dtype=torch.int64)
        prefix = torch.tensor([r.kv.kv_allocated_len for r, _ in entries], dtype=torch.int64)
        seq = prefix + torch.tensor([n for _, n in entries], dtype=torch.int64)
        last_loc = torch.where(prefix > 0, self._rows[rows, (prefix - 1).clamp(min=0)].to(torch.int64), -1)
        total = sum(n for _, n in entries)
        out = self.allocator.alloc_extend(prefix, prefix, seq, seq, last_loc, total)
        assert out is not None, "extend allocation failed after the room check"
        out32, pos = out.to(torch.int32), 0
        for r, n in entries:  # write_cache_indices' CPU path
            a = r.kv.kv_allocated_len
            self._rows[r.kv.req_pool_idx, a : a + n] = out32[pos : pos + n]
            pos += n
            r.kv.kv_allocated_len = r.kv.kv_committed_len = a + n

    def free(self, req: TraceRequest, preempted: bool) -> None:
        rec = req.handle
        self._reserved -= rec.reserved
        rec.reserved = 0
        kv = rec.kv
        if not preempted:  # release_kv_cache(checkpoint=True)
            self.tree.checkpoint(rec, up_to=kv.kv_committed_len)
        self.tree.free_kv_row(kv, [(kv.cache_protected_len, kv.kv_allocated_len)])
        self.tree.unlock(rec.lock)
        rec.lock = rec.last_node = None
        self.pool.free(rec)
        kv.mark_kv_released()
        rec.kv = self._s.ReqKvInfo()  # a re-admission starts from a fresh record
        if not preempted:
            req.handle = None

    def used_pages(self) -> int:
        free_or_evictable = self.allocator.available_size() + self.tree.evictable_size()
        return self.num_pages - free_or_evictable // self.page_size
