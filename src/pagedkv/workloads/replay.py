"""Replay a trace through `PagedKVCacheManager` the way a continuous-batching scheduler does.

Each step: admit waiting requests (claim + alloc; stop at the first that does
not fit), alloc one more slot for every decoding request (preempting the
newest on `InsufficientBlocksError`), build `runtime_inputs`, run the model
callback, `update` every context with its next token, `step`, and release
finished requests. Every manager call is timed in batches, so the clock's
own cost is spread over many requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from pagedkv.core.context import TextContext
from pagedkv.core.errors import InsufficientBlocksError
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.workloads.traces import TraceRequest, touches_page

__all__ = ["ReplayStats", "replay"]

Model = Callable[[Sequence[Sequence[TextContext]]], object]


# decode_* / step_decode: decode steps that need no new page and commit none; *_boundary: the others.
_PHASES = (
    "prefill_alloc", "decode_alloc", "decode_alloc_boundary", "step_prefill", "step_decode", "step_boundary",
    "runtime_inputs", "release",
)  # fmt: skip


@dataclass
class ReplayStats:
    """Call counts and seconds spent in each manager call during a replay."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PHASES, 0))
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    first_prompt_tokens: int = 0  # first admissions only (vLLM's prefix-cache stats)
    first_cached_tokens: int = 0
    token_budget: int | None = None
    admitted: set[int] = field(default_factory=set)
    peak_used_pages: int = 0
    wall_seconds: float = 0.0

    def micros(self, phase: str) -> float:
        """Mean microseconds per call of `phase` (0 when never called)."""
        return 1e6 * self.seconds[phase] / self.calls[phase] if self.calls[phase] else 0.0

    @property
    def prompt_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens admitted."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        """The same over first admissions only (re-admissions after preemption left out)."""
        return self.first_cached_tokens / self.first_prompt_tokens if self.first_prompt_tokens else 0.0


def replay(
    manager: PagedKVCacheManager,
    trace: Sequence[TraceRequest],
    *,
    max_batch_size: int,
    model: Model | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_num_batched_tokens: int | None = None,
) -> ReplayStats:
    """Serve every request of `trace` on replica 0; returns timings and counters.

    `max_num_batched_tokens` caps the prompt tokens admitted per step (at least one request).
    """
    stats = ReplayStats()
    stats.token_budget = max_num_batched_tokens
    waiting: deque[tuple[TraceRequest, TextContext]] = deque((r, TextContext(r.rid, r.prompt)) for r in trace)
    running: list[tuple[TraceRequest, TextContext]] = []
    done = 0
    start = time.perf_counter()
    while waiting or running:
        # as vLLM's scheduler: running requests first (preempting the newest when full), then admissions
        preempted = _decode_alloc(manager, waiting, running, stats)
        prefilling = set() if preempted else _admit(manager, waiting, running, max_batch_size, stats)
        batch = [c for _, c in running]
        with _clock(stats, "runtime_inputs", 1):
            manager.runtime_inputs([batch])
        if model is not None:
            model([batch])
        for req, c in running:
            c.update(int(req.output[len(c.tokens) - len(req.prompt)]))
        _step(manager, running, prefilling, stats)
        stats.peak_used_pages = max(stats.peak_used_pages, manager.get_num_used_pages())
        finished = [(r, c) for r, c in running if len(c.tokens) - len(r.prompt) >= len(r.output)]
        if finished:
            running = [(r, c) for r, c in running if len(c.tokens) - len(r.prompt) < len(r.output)]
            with _clock(stats, "release", len(finished)):
                for _, c in finished:
                    manager.release(c.request_id)
            done += len(finished)
            if progress:
                progress(done, len(trace))
        stats.steps += 1
    stats.wall_seconds = time.perf_counter() - start
    return stats


@contextmanager
def _clock(stats: ReplayStats, phase: str, count: int) -> Iterator[None]:
    """Add the block's seconds and `count` calls to `phase` (nothing if it raises)."""
    t0 = time.perf_counter()
    yield
    stats.seconds[phase] += time.perf_counter() - t0
    stats.calls[phase] += count


def _admit(manager: PagedKVCacheManager, waiting: deque, running: list, max_batch: int, stats: ReplayStats) -> set[int]:
    admitted: set[int] = set()
    budget = stats.token_budget
    while waiting and len(running) < max_batch and (budget is None or budget > 0 or not admitted):
        req, c = waiting[0]
        manager.claim(c.request_id)
        try:
            with _clock(stats, "prefill_alloc", 1):
                manager.alloc(c)
        except InsufficientBlocksError:
            manager.release(c.request_id)
            if running:
                break
            raise
        stats.prompt_tokens += len(c.tokens)
        stats.cached_prompt_tokens += c.cached_prefix_length
        if c.request_id not in stats.admitted:
            stats.admitted.add(c.request_id)
            stats.first_prompt_tokens += len(c.tokens)
            stats.first_cached_tokens += c.cached_prefix_length
        if budget is not None:
            budget -= c.tokens.active_length
        waiting.popleft()
        running.append((req, c))
        admitted.add(c.request_id)
    return admitted


def _crosses_page(c: TextContext, page_size: int) -> bool:
    """True when this decode step allocates a page (alloc) or fills one (step) for `c` (before its update)."""
    return touches_page(len(c.tokens), page_size)


def _decode_alloc(manager: PagedKVCacheManager, waiting: deque, running: list, stats: ReplayStats) -> bool:
    """alloc one more slot for every running request; True when someone had to be preempted."""
    preempted = False
    while True:
        decoding = [c for _, c in running]
        plain = [c for c in decoding if not _crosses_page(c, manager.page_size)]
        boundary = [c for c in decoding if _crosses_page(c, manager.page_size)]
        try:
            for phase, group in (("decode_alloc", plain), ("decode_alloc_boundary", boundary)):
                with _clock(stats, phase, len(group)):
                    for c in group:
                        manager.alloc(c)
        except InsufficientBlocksError:
            victim = running.pop()  # the newest request yields and is recomputed later
            manager.release(victim[1].request_id)
            victim[1].reset()
            waiting.appendleft(victim)
            stats.preemptions += 1
            preempted = True
            continue
        return preempted


def _step(manager: PagedKVCacheManager, running: list, prefilling: set, stats: ReplayStats) -> None:
    ps = manager.page_size
    groups: dict[str, list[TextContext]] = {"step_prefill": [], "step_decode": [], "step_boundary": []}
    for _, c in running:
        if c.request_id in prefilling:
            groups["step_prefill"].append(c)
        else:  # after update: the step that just ran had len(tokens) - 1 tokens
            groups["step_boundary" if touches_page(len(c.tokens) - 1, ps) else "step_decode"].append(c)
    for phase, group in groups.items():
        with _clock(stats, phase, len(group)):
            manager.step([group])
