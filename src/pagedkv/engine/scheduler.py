"""Continuous batching with chunked prefill and preemption (by swap to host, or by recompute).

Each step: (1) every running request gets its next window, decodes first and
then unfinished prefills, oldest first, within a token budget; a decode that
finds the pool full preempts the newest running request and puts it back at
the front of the queue: with swap (a host tier exists and has room) its pages
are copied to host rows and come back, bit for bit, when it is readmitted;
otherwise they are released, its context reset, and its generated tokens are
recomputed as prompt. (2) Waiting requests are
admitted while the budget, the batch size and the pool allow (`alloc` takes
prefix-cache hits first), their prompt chunked to what the budget has left.
"""

from __future__ import annotations

from collections import deque

from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.engine.request import Request
from pagedkv.manager.paged import PagedKVCacheManager

__all__ = ["Scheduler"]


class Scheduler:
    """Decides which requests run each step and how many of their tokens."""

    def __init__(
        self, manager: PagedKVCacheManager, max_num_batched_tokens: int, max_batch_size: int, swap: bool = False
    ) -> None:
        self.manager = manager
        self.swap = swap  # preempt by swapping to host rows when they have room
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.swaps = 0  # preemptions that swapped out instead of recomputing
        self.admitted_tokens = 0  # prompt tokens at admission (recomputed ones after preemption included)
        self.cached_tokens = 0  # of those, served from the prefix cache

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Request]:
        """The batch of this step; each request's `ctx.tokens` window is what it runs."""
        budget = self.max_num_batched_tokens
        batch: list[Request] = []
        for request in list(self.running):
            if budget == 0 or request not in self.running:  # preempted by an earlier request of this loop
                continue
            if not self._alloc_running(request, budget):
                continue
            budget -= self._window(request, budget)
            batch.append(request)
        batch.extend(self._admit(budget, len(batch)))
        return batch

    def _window(self, request: Request, budget: int) -> int:
        tokens = request.ctx.tokens
        if tokens.active_length > budget:
            tokens.chunk(budget)
        return tokens.active_length

    def _alloc_running(self, request: Request, budget: int) -> bool:
        """alloc for the next window (a decode or a prefill chunk), preempting the newest requests
        until it fits; False if `request` itself was preempted."""
        while True:
            try:
                self.manager.alloc(request.ctx, num_scheduled_tokens=budget)
                return True
            except InsufficientBlocksError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        if self.swap and self.manager.swap_out(request.request_id):
            self.swaps += 1
        else:
            self.manager.release(request.request_id)
            request.ctx.reset()
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, budget: int, batch_size: int) -> list[Request]:
        admitted: list[Request] = []
        while self.waiting and budget > 0 and batch_size + len(admitted) < self.max_batch_size:
            request = self.waiting[0]
            alone = not (self.running or admitted)
            swapped = self.manager.is_swapped(request.request_id)
            chunk = self._resume(request, budget, alone) if swapped else self._admit_one(request, budget, alone)
            if chunk is None:
                break  # wait for running requests to free pages
            self.waiting.popleft()
            if not swapped:  # a swapped request resumes where it stopped: no prompt is admitted again
                request.cached_tokens += request.ctx.cached_prefix_length
                self.admitted_tokens += len(request.ctx.tokens)
                self.cached_tokens += request.ctx.cached_prefix_length
            budget -= self._window(request, chunk)
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _admit_one(self, request: Request, budget: int, alone: bool) -> int | None:
        """claim + alloc `request` for a chunk of up to `budget` tokens; returns the chunk, or None to wait.

        Alone in the pool, a smaller chunk may fit where a large one does not
        (windowed layers hold pages for the tokens of one step): the chunk is
        halved until it fits; if even one token does not, the request can
        never fit and the error propagates.
        """
        self.manager.claim(request.request_id)
        chunk = budget
        while True:
            try:
                self.manager.alloc(request.ctx, num_scheduled_tokens=chunk)
                return chunk
            except InsufficientBlocksError:
                if not alone or chunk == 1:
                    self.manager.release(request.request_id)
                    if alone:
                        raise
                    return None
                chunk //= 2

    def _resume(self, request: Request, budget: int, alone: bool) -> int | None:
        """swap_in + alloc a swapped-out request for a chunk of up to `budget` tokens (None: wait)."""
        manager = self.manager
        if not alone and manager.num_free_blocks() <= manager.swapped_pages(request.request_id):
            return None  # its pages and a next one do not fit yet: do not copy back and forth
        try:
            self.manager.swap_in(request.ctx)
        except InsufficientBlocksError:
            if alone:
                raise
            return None
        try:
            self.manager.alloc(request.ctx, num_scheduled_tokens=budget)
        except InsufficientBlocksError:
            if self.manager.swap_out(request.request_id):  # back to host until pages free up
                return None
            self.manager.release(request.request_id)  # no host room left: recompute later instead
            request.ctx.reset()
            return None
        return budget

    def recompute_all(self) -> int:
        """Drop the KV of every running and swapped-out request (released, context reset) so that all of
        it is computed again; they wait, in their order, ahead of new requests. Returns how many."""
        dropped = list(self.running)
        for request in reversed(self.running):
            self.manager.release(request.request_id)
            request.ctx.reset()
            self.waiting.appendleft(request)
        self.running.clear()
        for request in self.waiting:
            if self.manager.is_swapped(request.request_id):
                self.manager.release(request.request_id)  # gives the host rows back
                request.ctx.reset()
                dropped.append(request)
        return len(dropped)

    def finish(self, request: Request) -> None:
        """Release a finished request's pages (after `step` committed them)."""
        self.running.remove(request)
        self.manager.release(request.request_id)
