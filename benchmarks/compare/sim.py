"""One scheduler loop for every cache manager compared: pagedkv, vLLM's, SGLang's and the bounds.

The loop is a miniature of vLLM's v1 scheduler (as vLLM's documentation of its
v1 `Scheduler` describes it; the peers are measured under it too), driven
through the small `CacheAdapter` protocol so each manager sees exactly the
same calls in the same order:

1. ``adapter.new_step()``.
2. Running requests, oldest first, while the token budget lasts: ``extend(req, n)``
   with n the next prefill chunk or 1. An adapter with a ``clip_chunk(req, n)``
   method (an engine whose scheduler shortens chunks, like vLLM's align-mode
   split for Mamba hybrids) is asked first and n becomes its answer; 0 skips
   the request for this step, as vLLM's scheduler does. On False the newest
   running request is preempted (``free(victim, preempted=True)``, its computed
   tokens forgotten, generated tokens kept) and requeued at the front, then the
   call is retried.
3. Waiting requests, unless something was preempted this step, while a batch
   slot and budget remain: ``admit(req, budget)`` returns (cached tokens, chunk)
   or None (does not fit: admissions stop for this step).
4. "Forward": every scheduled request's ``num_computed`` grows by its chunk;
   one that reached its end takes the next trace token. ``advance(batch)``
   then lets the manager commit, and finished requests are ``free``d.

A request with ``after`` set (the next turn of a conversation) joins the
queue only once that request has finished. Time spent inside adapter calls
is the bookkeeping cost; the driver's own work is not counted.

With ``SimConfig.page_size`` set, the steps that are plain decode steps for every request (one token
each, none taking a new page or filling one, nothing admitted, preempted or waiting) are also timed
on their own (``decode_seconds`` over ``decode_request_steps``: new_step + extend + advance). Such a
step's new_step and extends are timed as one interval (`_decode_extend`), so the figure holds the
manager's calls and not one clock read per call.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedkv.workloads.traces import TraceRequest, touches_page

__all__ = ["CacheAdapter", "SimConfig", "SimResult", "simulate"]


class CacheAdapter(Protocol):
    """What the loop asks of a cache manager. Every method may be timed."""

    name: str

    def new_step(self) -> None: ...

    def admit(self, req: TraceRequest, budget: int) -> tuple[int, int] | None:
        """Look up the cached prefix of ``req.live_tokens`` and make room for the first chunk.

        Returns (tokens served from the cache, chunk = min(uncached, budget)),
        or None when it does not fit (and then nothing changed)."""
        ...

    def extend(self, req: TraceRequest, n: int) -> bool:
        """Room for `n` more tokens of a running request; False (nothing changed) when full."""
        ...

    # Optional: ``clip_chunk(req, n) -> int`` (0 <= result <= n), the chunk the engine's own
    # scheduler would run for a running request offered `n` tokens; asked before `extend`.
    # Optional: ``lookahead(waiting)``, told at the start of each step which waiting requests come next
    # (the queue's head, up to the free batch slots), as the engine's scheduler tells its manager.

    def advance(self, batch: Sequence[tuple[TraceRequest, int]]) -> None:
        """After the forward pass: each request computed its chunk; a token was appended where
        ``num_computed == num_tokens - 1`` now holds (the driver already updated both)."""
        ...

    def free(self, req: TraceRequest, preempted: bool) -> None: ...

    def used_pages(self) -> int: ...


@dataclass(frozen=True)
class SimConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    page_size: int | None = None  # set: time the plain decode steps on their own (see module docstring)


@dataclass
class SimResult:
    """Counters and bookkeeping seconds of one replay."""

    name: str
    first_prompt_tokens: int = 0
    first_hit_tokens: int = 0
    prefill_tokens_computed: int = 0  # prompt tokens run through the model, re-admissions included
    preemptions: int = 0
    steps: int = 0
    request_steps: int = 0  # (request, step) pairs scheduled
    seconds: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("admit", "extend", "advance", "free", "lookahead"), 0.0)
    )
    peak_used_pages: int = 0
    first_admission_order: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    decode_seconds: float = 0.0  # plain decode steps (`SimConfig.page_size`), new_step + extend + advance
    decode_request_steps: int = 0

    @property
    def decode_us(self) -> float:
        """Microseconds of manager calls per request of a plain decode step (0 when none was timed)."""
        return 1e6 * self.decode_seconds / self.decode_request_steps if self.decode_request_steps else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens, over first admissions (vLLM's definition)."""
        return self.first_hit_tokens / self.first_prompt_tokens if self.first_prompt_tokens else 0.0

    @property
    def bookkeeping_us(self) -> float:
        """Microseconds of manager calls per scheduled request-step."""
        return 1e6 * sum(self.seconds.values()) / max(self.request_steps, 1)


def simulate(
    adapter: CacheAdapter,
    trace: Sequence[TraceRequest],
    config: SimConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Serve every request of `trace` (fresh copies) through `adapter`; returns its counters."""
    config = config or SimConfig()
    reqs = [r.fresh() for r in trace]
    followers: dict[int, list[TraceRequest]] = {}
    for r in reqs:
        if r.after is not None:
            followers.setdefault(r.after, []).append(r)
    waiting = deque(r for r in reqs if r.after is None)
    running: list[TraceRequest] = []
    res = SimResult(adapter.name)
    done, clock, sec = 0, time.perf_counter, res.seconds
    start = clock()
    lookahead = getattr(adapter, "lookahead", None)
    clip = getattr(adapter, "clip_chunk", None)
    while waiting or running:
        plain = config.page_size is not None and not waiting and _plain_decode(running, config.page_size)
        spent = sec["extend"] + sec["advance"]
        if plain and clip is None and len(running) <= config.max_num_batched_tokens:
            batch, preempted = _decode_extend(adapter, running, res), False
        else:
            t0 = clock()
            adapter.new_step()
            sec["extend"] += clock() - t0
            if lookahead is not None and waiting:  # the queue's head, as many as there are free batch slots
                head = list(itertools.islice(waiting, max(0, config.max_num_seqs - len(running))))
                t0 = clock()
                lookahead(head)
                sec["lookahead"] += clock() - t0
            budget = config.max_num_batched_tokens
            batch, preempted = _schedule_running(adapter, running, waiting, budget, res)
            budget -= sum(n for _, n in batch)
            if not preempted:
                _admit(adapter, waiting, running, batch, budget, config, res)
        finished = _forward(batch)
        t0 = clock()
        adapter.advance(batch)
        sec["advance"] += clock() - t0
        if plain and not preempted and len(batch) == len(running):
            res.decode_seconds += sec["extend"] + sec["advance"] - spent
            res.decode_request_steps += len(batch)
        res.request_steps += len(batch)
        res.peak_used_pages = max(res.peak_used_pages, adapter.used_pages())
        for r in finished:
            running.remove(r)
            t0 = clock()
            adapter.free(r, preempted=False)
            sec["free"] += clock() - t0
            waiting.extend(followers.pop(r.rid, ()))
        done += len(finished)
        if progress and finished:
            progress(done, len(reqs))
        res.steps += 1
    res.wall_seconds = clock() - start
    return res


def _schedule_running(adapter: CacheAdapter, running: list[TraceRequest], waiting: deque, budget: int,
                      res: SimResult) -> tuple[list[tuple[TraceRequest, int]], bool]:  # fmt: skip
    batch: list[tuple[TraceRequest, int]] = []
    preempted = False
    clock, sec = time.perf_counter, res.seconds
    clip = getattr(adapter, "clip_chunk", None)
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_tokens - req.num_computed, budget)
        t0 = clock()
        if clip is not None:
            n = clip(req, n)
        ok = n > 0 and adapter.extend(req, n)
        sec["extend"] += clock() - t0
        if n == 0:  # the engine's scheduler runs nothing of it this step
            i += 1
            continue
        if ok:
            batch.append((req, n))
            budget -= n
            i += 1
            continue
        victim = running.pop()  # the newest yields and is recomputed later
        t0 = clock()
        adapter.free(victim, preempted=True)
        sec["free"] += clock() - t0
        victim.num_computed = 0
        waiting.appendleft(victim)
        res.preemptions += 1
        preempted = True
        if victim is req:
            break
    return batch, preempted


def _decode_extend(
    adapter: CacheAdapter, running: list[TraceRequest], res: SimResult
) -> list[tuple[TraceRequest, int]]:
    """A plain decode step's ``new_step`` and one-token ``extend`` of every running request, in the order
    `_schedule_running` makes them, timed as one interval: two clock reads a step instead of two a request,
    whose own cost (about 0.1 us) would otherwise weigh on a figure under 1 us. RuntimeError when the
    adapter refuses a token that needs no new page (a manager bug: nothing is preempted for it)."""
    batch = [(req, 1) for req in running]
    extend, clock = adapter.extend, time.perf_counter
    t0 = clock()
    adapter.new_step()
    for req in running:
        if not extend(req, 1):
            raise RuntimeError(f"{adapter.name}: extend refused request {req.rid}'s decode token, which needs no page")
    res.seconds["extend"] += clock() - t0
    return batch


def _admit(adapter: CacheAdapter, waiting: deque, running: list[TraceRequest], batch: list, budget: int,
           config: SimConfig, res: SimResult) -> None:  # fmt: skip
    clock = time.perf_counter
    while waiting and len(running) < config.max_num_seqs and budget > 0:
        req = waiting[0]
        t0 = clock()
        got = adapter.admit(req, budget)
        res.seconds["admit"] += clock() - t0
        if got is None:
            break
        hit, n = got
        waiting.popleft()
        req.num_computed = hit
        if req.admissions == 0:
            res.first_prompt_tokens += req.prompt_len
            res.first_hit_tokens += min(hit, req.prompt_len)
            res.first_admission_order.append(req.rid)
        res.prefill_tokens_computed += req.num_tokens - hit
        req.admissions += 1
        running.append(req)
        batch.append((req, n))
        budget -= n


def _plain_decode(running: list[TraceRequest], page_size: int) -> bool:
    """Whether every running request is due a one-token step that neither takes a page nor fills one."""
    for req in running:
        if req.num_computed != req.num_tokens - 1 or touches_page(req.num_tokens, page_size):
            return False
    return bool(running)


def _forward(batch: list[tuple[TraceRequest, int]]) -> list[TraceRequest]:
    """Advance every scheduled request by its chunk; returns those that generated their last token."""
    finished = []
    for req, n in batch:
        req.num_computed += n
        if req.num_computed == req.num_tokens:
            req.num_output += 1
            if req.num_output == req.output_len:
                finished.append(req)
    return finished
