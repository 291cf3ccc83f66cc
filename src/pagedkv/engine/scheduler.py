"""Continuous batching with chunked prefill and preemption by recompute.

Each step: (1) every running request gets its next window, decodes first and
then unfinished prefills, oldest first, within a token budget; a decode that
finds the pool full preempts the newest running request (its pages are
released, its context reset and it goes back to the front of the queue;
generated tokens are kept and recomputed as prompt). (2) Waiting requests are
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

    def __init__(self, manager: PagedKVCacheManager, max_num_batched_tokens: int, max_batch_size: int) -> None:
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
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
            tokens = request.ctx.tokens
            if tokens.active_length == 1 and not self._alloc_decode(request):
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

    def _alloc_decode(self, request: Request) -> bool:
        """alloc for a decode step, preempting the newest requests until it fits; False if it was preempted."""
        while True:
            try:
                self.manager.alloc(request.ctx)
                return True
            except InsufficientBlocksError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.release(request.request_id)
        request.ctx.reset()
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, budget: int, batch_size: int) -> list[Request]:
        admitted: list[Request] = []
        while self.waiting and budget > 0 and batch_size + len(admitted) < self.max_batch_size:
            request = self.waiting[0]
            self.manager.claim(request.request_id)
            try:
                self.manager.alloc(request.ctx)
            except InsufficientBlocksError:
                self.manager.release(request.request_id)
                if self.running or admitted:
                    break  # wait for running requests to free pages
                raise  # nothing else holds pages: this request can never fit
            self.waiting.popleft()
            request.cached_tokens += request.ctx.cached_prefix_length
            self.admitted_tokens += len(request.ctx.tokens)
            self.cached_tokens += request.ctx.cached_prefix_length
            budget -= self._window(request, budget)
            self.running.append(request)
            admitted.append(request)
        return admitted

    def finish(self, request: Request) -> None:
        """Release a finished request's pages (after `step` committed them)."""
        self.running.remove(request)
        self.manager.release(request.request_id)
