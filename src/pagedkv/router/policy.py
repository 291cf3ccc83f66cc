"""`Router`: picks an engine for a request from the `PrefixIndex` scores and each engine's load.

The policy (``mode="kv"``):

1. Candidates are the *live* engines: heard from (a KV event, or a load report) within
   ``stale_after_s``, and not failed (`mark_failed`) within ``retry_after_s``. When none is live,
   every engine not failed recently is a candidate (reason ``"all-stale"``), then every engine (the one
   that failed longest ago first): the router degrades to load balancing, and it never keeps sending
   to an engine that stopped answering.
2. ``load(e) = max(running + waiting it reported, requests the router has in flight on it)``.
3. The engine with the longest cached prefix (ties: the least loaded, then rotation) wins (reason
   ``"prefix"``), unless it is *overloaded*: ``load >= least load + load_margin``, or it reported fewer
   free pages than the request's uncached part needs. Then, and when no engine holds any prefix, the
   least-loaded candidate wins (``"overloaded"``, ``"least-loaded"``; ties rotate).

``mode="round-robin"`` and ``mode="random"`` ignore the scores (baselines; staleness still applies).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.router.index import PrefixIndex

__all__ = ["Decision", "EngineLoad", "Router", "RouterPolicy", "RouterStats", "MODES"]

MODES = ("kv", "round-robin", "random")


@dataclass(frozen=True)
class RouterPolicy:
    """The policy's knobs (see the module docstring).

    Attributes:
        mode: "kv", "round-robin" or "random".
        load_margin: requests by which the best-prefix engine may exceed the least-loaded one.
        stale_after_s: an engine not heard from for this long is not routed to while others are live.
        retry_after_s: an engine that failed a request is skipped for this long.
        seed: seed of ``mode="random"``.
    """

    mode: str = "kv"
    load_margin: int = 4
    stale_after_s: float = 10.0
    retry_after_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        if type(self.load_margin) is not int or self.load_margin < 1:
            raise ValueError(f"load_margin={self.load_margin!r} must be an int >= 1")
        for name in ("stale_after_s", "retry_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number > 0")


@dataclass
class EngineLoad:
    """What an engine last reported (`Router.report_load`) and what the router knows itself."""

    running: int = 0
    waiting: int = 0
    free_pages: int | None = None
    total_pages: int | None = None
    reported_at: float | None = None  # the router's clock
    in_flight: int = 0  # requests routed to it and not finished (`Router.finished`)
    failed_at: float | None = None


@dataclass(frozen=True)
class Decision:
    """One routing decision.

    Attributes:
        engine: the chosen engine; reason: "prefix", "overloaded", "least-loaded", "all-stale",
        "round-robin" or "random"; predicted_tokens: the chosen engine's score (leading tokens it
        holds); scores, loads: per candidate; prompt_tokens: the request's length; latency_s: time
        the decision took (hashing included).
    """

    engine: str
    reason: str
    predicted_tokens: int
    prompt_tokens: int
    scores: dict[str, int]
    loads: dict[str, int]
    latency_s: float


@dataclass
class RouterStats:
    """Counters over the router's life (see `Router.stats`)."""

    decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (engine, reason) -> count
    prompt_tokens: int = 0
    predicted_tokens: dict[str, int] = field(default_factory=dict)
    actual_tokens: dict[str, int] = field(default_factory=dict)  # cached tokens the engines reported
    outcomes: int = 0  # decisions whose outcome was reported
    exact: int = 0  # of those, predicted == reported
    decision_seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)


class Router:
    """Routes requests over the engines of `index` (see the module docstring for the policy).

    Args:
        index: the prefix index (its engines are the router's).
        policy: the knobs.
        clock: monotonic seconds (tests pass a fake one); must agree with `time.monotonic` for the
            index's message times.

    Thread-safe: one lock guards loads and stats.
    """

    def __init__(
        self, index: PrefixIndex, policy: RouterPolicy | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.index = index
        self.policy = policy or RouterPolicy()
        self.engines = list(index.engines)
        self._clock = clock
        self._loads = {name: EngineLoad() for name in self.engines}
        self._lock = threading.Lock()
        self._turn = 0
        self._random = random.Random(self.policy.seed)
        self.stats = RouterStats()

    # ----------------------------------------------------------------- engine state
    def report_load(
        self, name: str, running: int, waiting: int = 0, free_pages: int | None = None, total_pages: int | None = None
    ) -> None:
        """Record an engine's load (a scrape answered): it counts as heard from now. KeyError for an
        unknown engine."""
        with self._lock:
            load = self._load(name)
            load.running, load.waiting, load.free_pages, load.total_pages = running, waiting, free_pages, total_pages
            load.reported_at = self._clock()

    def mark_failed(self, name: str) -> None:
        """An engine failed a request or a scrape: skip it for ``retry_after_s``."""
        with self._lock:
            self._load(name).failed_at = self._clock()
            self.stats.failures[name] = self.stats.failures.get(name, 0) + 1

    def finished(self, decision: Decision, cached_tokens: int | None = None) -> None:
        """The request of `decision` finished (its in-flight count drops); `cached_tokens`: the prefix hit
        the engine reported, compared with the prediction in the stats."""
        with self._lock:
            load = self._load(decision.engine)
            load.in_flight = max(0, load.in_flight - 1)
            if cached_tokens is not None:
                s = self.stats
                s.outcomes += 1
                s.exact += cached_tokens == decision.predicted_tokens
                s.actual_tokens[decision.engine] = s.actual_tokens.get(decision.engine, 0) + cached_tokens

    def loads(self) -> dict[str, EngineLoad]:
        """A copy of every engine's load record."""
        with self._lock:
            return {n: EngineLoad(**vars(load)) for n, load in self._loads.items()}

    def is_live(self, name: str) -> bool:
        """Heard from within ``stale_after_s`` and not failed within ``retry_after_s``."""
        with self._lock:
            return self._live(name, self._clock())

    def _load(self, name: str) -> EngineLoad:
        load = self._loads.get(name)
        if load is None:
            raise KeyError(f"engine={name!r} is not one of {self.engines}")
        return load

    def _failed_recently(self, name: str, now: float) -> bool:
        failed = self._loads[name].failed_at
        return failed is not None and now - failed < self.policy.retry_after_s

    def _live(self, name: str, now: float) -> bool:
        heard = [t for t in (self.index.last_message(name), self._loads[name].reported_at) if t is not None]
        return bool(heard) and now - max(heard) <= self.policy.stale_after_s and not self._failed_recently(name, now)

    def _load_of(self, name: str) -> int:
        load = self._loads[name]
        return max(load.running + load.waiting, load.in_flight)

    # ----------------------------------------------------------------- routing
    def route(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> Decision:
        """Choose an engine for `tokens` (with `salt`) and count the request in flight there (call
        `finished` when it ends). Never raises for engine state: some engine is always chosen."""
        start = time.perf_counter()
        scores = self.index.score(tokens, salt) if self.policy.mode == "kv" else {}
        with self._lock:
            now = self._clock()
            candidates = [n for n in self.engines if self._live(n, now)]
            stale = not candidates
            if stale:
                candidates = [n for n in self.engines if not self._failed_recently(n, now)]
            if not candidates:  # every engine failed recently: retry the one that failed longest ago
                candidates = [min(self.engines, key=lambda n: self._loads[n].failed_at or 0.0)]
            loads = {n: self._load_of(n) for n in candidates}
            engine, reason = self._choose(candidates, loads, scores, len(tokens))
            if stale:
                reason = "all-stale"
            predicted = scores.get(engine, 0)
            self._loads[engine].in_flight += 1
            latency = time.perf_counter() - start
            s = self.stats
            s.decisions[(engine, reason)] = s.decisions.get((engine, reason), 0) + 1
            s.prompt_tokens += len(tokens)
            s.predicted_tokens[engine] = s.predicted_tokens.get(engine, 0) + predicted
            s.decision_seconds += latency
        return Decision(
            engine, reason, predicted, len(tokens), {n: scores.get(n, 0) for n in candidates}, loads, latency
        )

    def _rotate(self, names: list[str]) -> str:
        self._turn += 1
        return names[self._turn % len(names)]

    def _choose(self, candidates: list[str], loads: dict[str, int], scores: dict[str, int], n: int) -> tuple[str, str]:
        mode = self.policy.mode
        if mode == "round-robin":
            return self._rotate(candidates), mode
        if mode == "random":
            return self._random.choice(candidates), mode
        least = min(loads.values())
        idle = [c for c in candidates if loads[c] == least]
        best = max(scores.get(c, 0) for c in candidates)
        if best == 0:
            return self._rotate(idle), "least-loaded"
        top = [c for c in candidates if scores.get(c, 0) == best]
        lightest = min(loads[c] for c in top)
        chosen = self._rotate([c for c in top if loads[c] == lightest])
        if loads[chosen] >= least + self.policy.load_margin or self._short_of_pages(chosen, n - best):
            return self._rotate(idle), "overloaded"
        return chosen, "prefix"

    def _short_of_pages(self, name: str, uncached: int) -> bool:
        free = self._loads[name].free_pages
        if free is None:
            return False
        block = self.index.engines[name].hasher.block_size
        return free < -(-uncached // block)
