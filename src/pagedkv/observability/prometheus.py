"""A Prometheus collector for `PagedKVCacheManager` (``pip install 'pagedkv[metrics]'``).

`PagedKVCollector(manager)` reads the manager at every scrape (nothing is
recorded in between, and nothing runs when nobody scrapes); register it on a
`prometheus_client.CollectorRegistry`, or let `start_metrics_server` serve it
over HTTP. Every series has labels ``replica`` (the data-parallel replica) and,
where it applies, ``tier``: "device" (the page pool), "host", "disk", "redis".

Gauges: ``pagedkv_pages_{used,free,cached,capacity}`` (device: held by running requests, free
incl. evictable cached, holding a prefix hash, pool size; host and disk: rows holding KV,
empty rows, same as used, size), ``pagedkv_pages_checkpoint`` (device: pages holding only
recurrent-state checkpoints, evictable: counted in free, not in used), ``pagedkv_hit_rate`` (device: cached tokens / prompt
tokens, tier hits included; tiers: pages loaded / pages looked up).
Counters (``_total``): ``pagedkv_prefix_cache_{queries,hits}`` (tokens),
``pagedkv_evictions``, ``pagedkv_tier_{lookups,hits,errors,refused,skipped_writes}`` (pages or
operations), ``pagedkv_tier_transfer_{pages,bytes}`` and ``pagedkv_tier_swapped_pages`` with
``direction`` ("store": device to tier, "load": tier to device; swaps "out"/"in"), and the KV
event publishers' ``pagedkv_kv_events_{published,dropped,errors}`` (label ``endpoint``).
Histogram: ``pagedkv_tier_transfer_latency_seconds`` (seconds per batch operation, buckets
`LATENCY_BUCKETS`, label ``direction``). Counters restart from 0 after `reset_metrics`.

Scrapes run on the server's thread and are not synchronised with the engine: each value is
read atomically, but two values of one scrape may straddle a step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.core.metrics import KVCacheMetrics
from pagedkv.offload.tier_stats import LATENCY_BUCKETS

if TYPE_CHECKING:
    from pagedkv.manager.paged import PagedKVCacheManager

__all__ = ["MetricsServer", "PagedKVCollector", "start_metrics_server"]

_EXTRA = "pip install 'pagedkv[metrics]'"
_TIER_COUNTERS = (  # (metric, TierStats key, help)
    ("pagedkv_tier_lookups", "lookups", "Pages asked of the tier by loads."),
    ("pagedkv_tier_hits", "pages_loaded", "Pages the tier served (loaded into the device)."),
    ("pagedkv_tier_errors", "errors", "Failed tier operations (I/O error, connection lost, disk full)."),
    ("pagedkv_tier_refused", "refused", "Pages read but refused (bad header, wrong layout, checksum)."),
    ("pagedkv_tier_skipped_writes", "skipped_writes", "Writes not done (tier down, full, or page pinned)."),
)


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError as exc:
        raise ImportError(f"the Prometheus exporter needs prometheus_client: {_EXTRA}") from exc
    return prometheus_client


class PagedKVCollector:
    """A custom collector (``registry.register(PagedKVCollector(mgr))``) of `manager`'s page usage,
    hit rates, evictions, tier transfers, errors and latencies, and its KV event publishers.

    Args:
        manager: the `PagedKVCacheManager` to read (only read).
        publishers: objects with ``endpoint``, ``published``, ``dropped`` and ``errors`` (a
            `ZmqEventPublisher`); by default, those among the manager's KV event listeners.

    Raises ImportError (naming the extra) when prometheus_client is missing.
    """

    def __init__(self, manager: PagedKVCacheManager, publishers: Sequence[Any] | None = None) -> None:
        self._prom = _prometheus()
        self.manager = manager
        self.publishers = None if publishers is None else list(publishers)

    def _publishers(self) -> list[Any]:
        if self.publishers is not None:
            return self.publishers
        listeners = getattr(getattr(self.manager, "tiers", None), "listeners", [])
        return [p for p in listeners if all(isinstance(getattr(p, n, None), int) for n in ("published", "dropped"))]

    def collect(self) -> Iterator[Any]:
        """Every metric family, read from the manager now. No side effects."""
        core = self._prom.core
        gauge, counter = core.GaugeMetricFamily, core.CounterMetricFamily
        pages = {
            kind: gauge(f"pagedkv_pages_{kind}", doc, labels=["tier", "replica"])
            for kind, doc in (("used", "Pages in use (device: held by running requests; tiers: holding KV)."),
                              ("free", "Pages an allocation or a write can take (device: incl. evictable cached)."),
                              ("cached", "Pages holding a prefix-cache key."), ("capacity", "Pages in the tier."),
                              ("checkpoint", "Device pages holding only recurrent-state checkpoints (evictable)."))
        }  # fmt: skip
        hit_rate = gauge("pagedkv_hit_rate", "Device: cached / prompt tokens; tiers: pages loaded / looked up.",
                         labels=["tier", "replica"])  # fmt: skip
        queries = counter("pagedkv_prefix_cache_queries", "Prompt tokens asked for (computed + cached).",
                          labels=["replica"])  # fmt: skip
        hits = counter("pagedkv_prefix_cache_hits", "Prompt tokens served from the cache.", labels=["replica"])
        evictions = counter("pagedkv_evictions", "Cached pages dropped to make room.", labels=["tier", "replica"])
        tier_counters = [(counter(name, doc, labels=["tier", "replica"]), key) for name, key, doc in _TIER_COUNTERS]
        moved = {
            unit: counter(f"pagedkv_tier_transfer_{unit}", f"{unit.capitalize()} moved between the device and a tier.",
                          labels=["tier", "replica", "direction"])
            for unit in ("pages", "bytes")
        }  # fmt: skip
        swapped = counter("pagedkv_tier_swapped_pages", "Pages of preempted requests swapped out to / in from a tier.",
                          labels=["tier", "replica", "direction"])  # fmt: skip
        latency = core.HistogramMetricFamily("pagedkv_tier_transfer_latency_seconds", "Seconds per tier batch operation.",
                                             labels=["tier", "replica", "direction"])  # fmt: skip
        mgr = self.manager
        for r in range(mgr.num_replicas):
            rep = str(r)
            metrics: KVCacheMetrics = mgr.get_metrics(r)
            for kind, value in (("used", metrics.used_pages), ("free", metrics.total_pages - metrics.used_pages),
                                ("cached", metrics.cached_pages), ("capacity", metrics.total_pages),
                                ("checkpoint", metrics.checkpoint_pages)):  # fmt: skip
                pages[kind].add_metric(["device", rep], value)
            hit_rate.add_metric(["device", rep], metrics.cache_hit_rate)
            queries.add_metric([rep], metrics.prompt_tokens)
            hits.add_metric([rep], metrics.cache_tokens)
            evictions.add_metric(["device", rep], metrics.evictions)
            stats = mgr.tier_stats(r)
            for tier in ("host", "disk"):
                if tier in stats:
                    capacity, used = self._tier_pages(tier, r)
                    for kind, value in (("used", used), ("free", capacity - used), ("cached", used),
                                        ("capacity", capacity)):  # fmt: skip
                        pages[kind].add_metric([tier, rep], value)
            for tier, snap in stats.items():
                labels = [tier, rep]
                hit_rate.add_metric(labels, float(snap["hit_rate"]))  # type: ignore[arg-type]
                evictions.add_metric(labels, snap["evictions"])
                for family, key in tier_counters:
                    family.add_metric(labels, snap[key])
                for direction in ("store", "load"):
                    past = "stored" if direction == "store" else "loaded"
                    moved["pages"].add_metric([*labels, direction], snap[f"pages_{past}"])
                    moved["bytes"].add_metric([*labels, direction], snap[f"bytes_{past}"])
                    latency.add_metric([*labels, direction], *self._buckets(snap[f"{direction}_latency"]))
                for direction in ("out", "in"):
                    if f"pages_swapped_{direction}" in snap:
                        swapped.add_metric([*labels, direction], snap[f"pages_swapped_{direction}"])
        yield from pages.values()
        yield from (hit_rate, queries, hits, evictions, *(f for f, _ in tier_counters), *moved.values(), swapped)
        yield latency
        yield from self._publisher_families(counter)

    def _tier_pages(self, tier: str, r: int) -> tuple[int, int]:
        if tier == "host":
            return self.manager.get_num_host_pages(r), self.manager.get_num_used_host_pages(r)
        return self.manager.get_num_disk_pages(r), self.manager.get_num_used_disk_pages(r)

    def _buckets(self, hist: Any) -> tuple[list[tuple[str, float]], float]:
        """`TierStats` histogram ``(counts per bucket, sum, count)`` as cumulative Prometheus buckets."""
        counts, total, count = hist
        fmt = self._prom.utils.floatToGoString
        buckets, running = [], 0
        for bound, n in zip(LATENCY_BUCKETS, counts, strict=False):
            running += n
            buckets.append((fmt(bound), float(running)))
        buckets.append(("+Inf", float(count)))
        return buckets, float(total)

    def _publisher_families(self, counter: Any) -> Iterator[Any]:
        publishers = self._publishers()
        if not publishers:
            return
        for attr, doc in (("published", "KV event batches sent."),
                          ("dropped", "KV event batches dropped (publisher queue full or closed)."),
                          ("errors", "KV event batches that failed to encode or send.")):  # fmt: skip
            family = counter(f"pagedkv_kv_events_{attr}", doc, labels=["endpoint"])
            for pub in publishers:
                family.add_metric([str(getattr(pub, "endpoint", ""))], int(getattr(pub, attr, 0)))
            yield family


@dataclass
class MetricsServer:
    """A running `/metrics` HTTP server: `port` is the bound port; `close()` stops it."""

    registry: Any
    collector: PagedKVCollector
    server: Any
    thread: Any
    port: int

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def start_metrics_server(
    manager: PagedKVCacheManager, port: int = 9400, addr: str = "0.0.0.0", registry: Any = None
) -> MetricsServer:
    """Serve `manager`'s metrics on ``http://addr:port/metrics`` from a daemon thread (``port=0``: a
    free port, see `MetricsServer.port`). The collector is registered on `registry` (a new
    `CollectorRegistry` by default, so the process's default metrics are not mixed in)."""
    prom = _prometheus()
    registry = prom.CollectorRegistry() if registry is None else registry
    collector = PagedKVCollector(manager)
    registry.register(collector)
    started = prom.start_http_server(port, addr=addr, registry=registry)
    if not isinstance(started, tuple):  # prometheus_client < 0.17 returns nothing
        raise ImportError(f"start_metrics_server needs prometheus_client >= 0.17: {_EXTRA}")
    server, thread = started
    return MetricsServer(registry, collector, server, thread, int(server.server_port))
