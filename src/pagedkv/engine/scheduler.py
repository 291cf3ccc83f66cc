"""Continuous batching with chunked prefill and preemption (by swap to host, or by recompute).

Each step: (1) every running request gets its next window, decodes first and
then unfinished prefills, oldest first, within a token budget; a decode that
finds the pool full preempts the newest running request and puts it back at
the front of the queue: with swap (a host tier exists and has room) its pages
are copied to host rows and come back, bit for bit, when it is readmitted;
otherwise they are released, its context reset, and its generated tokens are
recomputed as prompt. A request that runs alone halves its chunk instead of
preempting itself. (2) Waiting requests are
admitted while the budget, the batch size and the pool allow (`alloc` takes
prefix-cache hits first), their prompt chunked to what the budget has left.
At the start of each step the queue's head is told to the manager
(`PagedKVCacheManager.expect`): the cached pages those requests will hit are
evicted last, those of requests further back first.

Every step makes progress or raises: the oldest request either gets pages
(by preempting newer ones, then by shrinking its chunk to one token) or can
never run with the whole pool to itself, and then it is dropped and
`InsufficientBlocksError` names it, what it needs and the pool. `add_request`
refuses such requests up front (`pagedkv.engine.checks.check_fits`), so this
is a safety net, not a path.
"""

from __future__ import annotations

import itertools
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
        self._cuts = manager.num_state_rows > 0  # (only models with recurrent state have checkpoint cuts)
        self._expect = bool(manager.params.enable_prefix_caching)
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
        if self._expect and self.waiting:  # queue-aware retention: what the queue's head will hit is kept
            head = itertools.islice(self.waiting, max(0, self.max_batch_size - len(self.running)))
            self.manager.expect([r.ctx for r in head])
        for request in list(self.running):
            if budget == 0 or request not in self.running:  # preempted by an earlier request of this loop
                continue
            chunk = self._alloc_running(request, budget)
            if chunk is None:
                continue
            budget -= self._window(request, chunk)
            batch.append(request)
        batch.extend(self._admit(budget, len(batch)))
        return batch

    def _window(self, request: Request, budget: int) -> int:
        tokens = request.ctx.tokens
        cut = self.manager.checkpoint_cut(request.request_id) if self._cuts else None  # a state checkpoint is due
        if cut is not None and tokens.processed_length < cut < tokens.processed_length + budget:
            budget = cut - tokens.processed_length
        if tokens.active_length > budget:
            tokens.chunk(budget)
        return tokens.active_length

    def _alloc_running(self, request: Request, budget: int) -> int | None:
        """alloc for the next window (a decode or a prefill chunk) of up to `budget` tokens; returns the
        chunk it got pages for, or None if `request` itself was preempted.

        When the pool is short it preempts the newest running requests; once `request` runs alone it
        halves its chunk instead (a window group holds the pages of one step, so a smaller chunk may
        fit). Alone at one token, it is preempted (restarted) once at this context length: window
        pages it shares with the prefix cache (a hit, a merged commit) are never dropped while it
        runs, and a restart gives them back. Stuck again at the same length, it can never progress:
        it is dropped from the engine (its pages released) and `InsufficientBlocksError` names it,
        its need and the pool; the requests behind it run on at the next step.
        """
        chunk = budget
        while True:
            try:
                self.manager.alloc(request.ctx, num_scheduled_tokens=chunk)
                return chunk
            except InsufficientBlocksError as error:
                if self.running == [request]:
                    if chunk > 1:
                        chunk //= 2
                        continue
                    length = len(request.ctx.tokens)
                    if request.restarted_at == length:  # restarting did not help: it can never progress
                        self.running.remove(request)
                        self.manager.release(request.request_id)
                        raise self._stuck(request, error) from error
                    request.restarted_at = length  # once per length: pages it shares with the prefix
                    self._preempt(request)  # cache stay held until it restarts, so restart it
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    return None

    def _stuck(self, request: Request, error: InsufficientBlocksError) -> InsufficientBlocksError:
        """The error of a request that cannot take one more token with the whole pool to itself."""
        pool = self.manager.total_num_pages
        return InsufficientBlocksError(
            f"request {request.request_id!r} ({len(request.ctx.tokens)} tokens, "
            f"{request.ctx.tokens.processed_length} processed) cannot run one more token alone: it needs "
            f"{error.needed} more pages and {error.available} of the pool's {pool} are free ({error}); "
            "raise num_pages or memory_budget",
            needed=error.needed,
            available=error.available,
        )

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
        if self._expect:  # (its cached prefix is wanted from now on, before any later eviction of this step)
            self.manager.expect([request.ctx])

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
        never fit: it leaves the queue and `InsufficientBlocksError` names it, its need and the pool.
        """
        self.manager.claim(request.request_id)
        chunk = budget
        while True:
            try:
                self.manager.alloc(request.ctx, num_scheduled_tokens=chunk)
                return chunk
            except InsufficientBlocksError as error:
                if not alone or chunk == 1:
                    self.manager.release(request.request_id)
                    if alone:
                        self.waiting.remove(request)
                        self.manager.unexpect(request.request_id)
                        raise self._stuck(request, error) from error
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

    def drop(self, request: Request) -> bool:
        """Take `request` out of the running set or the queue and give back all it holds: its device pages,
        the host rows of a swapped-out request, what `expect` kept for it. False (nothing changes) when it
        is in neither (finished, or already dropped)."""
        if any(r is request for r in self.running):
            self.running.remove(request)
        elif any(r is request for r in self.waiting):
            self.waiting.remove(request)
            self.manager.unexpect(request.request_id)
        else:
            return False
        rid = request.request_id
        if self.manager.contains(rid) or self.manager.is_swapped(rid):
            self.manager.release(rid)
        return True
