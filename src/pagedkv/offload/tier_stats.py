"""`TierStats`: counters and latency histograms of one tier (host, disk, redis), thread-safe."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

__all__ = ["LATENCY_BUCKETS", "TierStats"]

# seconds; the upper bounds of the latency histograms (Prometheus-style, +Inf implied)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Counts per `LATENCY_BUCKETS` bucket (last: above every bound), their sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1


@dataclass
class TierStats:
    """What one tier did since it started (or since `reset`).

    Attributes:
        pages_stored / bytes_stored: pages written into the tier (offload).
        pages_loaded / bytes_loaded: pages read from the tier into the device (hits).
        lookups: pages asked for by `load`; `pages_loaded / lookups` is the tier's hit rate.
        evictions: pages the tier dropped to make room.
        errors: failed operations (I/O error, connection lost, disk full).
        refused: pages read but refused (bad header, wrong layout, checksum mismatch).
        skipped_writes: writes not done (tier down, full, or the page pinned elsewhere).
        pages_swapped_out / pages_swapped_in: pages of preempted requests parked in host rows and back.
        store_latency / load_latency: seconds per batch operation.
    """

    name: str
    pages_stored: int = 0
    bytes_stored: int = 0
    pages_loaded: int = 0
    bytes_loaded: int = 0
    lookups: int = 0
    evictions: int = 0
    errors: int = 0
    refused: int = 0
    skipped_writes: int = 0
    pages_swapped_out: int = 0
    pages_swapped_in: int = 0
    store_latency: Histogram = field(default_factory=Histogram)
    load_latency: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Increase the named counters."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def observe(self, kind: str, seconds: float) -> None:
        """Record one batch operation's latency (`kind`: "store" or "load")."""
        with self._lock:
            (self.store_latency if kind == "store" else self.load_latency).observe(seconds)

    @property
    def hit_rate(self) -> float:
        """`pages_loaded / lookups` (0.0 before any lookup)."""
        return self.pages_loaded / self.lookups if self.lookups else 0.0

    def snapshot(self) -> dict[str, object]:
        """Every counter and histogram as plain values (a consistent copy)."""
        with self._lock:
            return {
                "name": self.name, "pages_stored": self.pages_stored, "bytes_stored": self.bytes_stored,
                "pages_loaded": self.pages_loaded, "bytes_loaded": self.bytes_loaded, "lookups": self.lookups,
                "evictions": self.evictions, "errors": self.errors, "refused": self.refused,
                "skipped_writes": self.skipped_writes, "pages_swapped_out": self.pages_swapped_out,
                "pages_swapped_in": self.pages_swapped_in, "hit_rate": self.hit_rate,
                "store_latency": (list(self.store_latency.counts), self.store_latency.total, self.store_latency.count),
                "load_latency": (list(self.load_latency.counts), self.load_latency.total, self.load_latency.count),
            }  # fmt: skip

    def reset(self) -> None:
        """Zero every counter and histogram."""
        with self._lock:
            for name in ("pages_stored", "bytes_stored", "pages_loaded", "bytes_loaded", "lookups", "evictions",
                         "errors", "refused", "skipped_writes", "pages_swapped_out", "pages_swapped_in"):  # fmt: skip
                setattr(self, name, 0)
            self.store_latency, self.load_latency = Histogram(), Histogram()
