"""The Prometheus exporter: exact values after a scripted two-replica run over a host tier, and a real scrape."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import ctx, make_params  # noqa: E402
from pagedkv.dtype import DeviceRef  # noqa: E402
from pagedkv.manager.paged import PagedKVCacheManager  # noqa: E402
from pagedkv.observability import PagedKVCollector, start_metrics_server  # noqa: E402
from pagedkv.offload.tier_stats import LATENCY_BUCKETS  # noqa: E402
from pagedkv.testing import PrefixStampModel  # noqa: E402

CPU = DeviceRef.CPU()
LOCAL = dict(enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=1)
PROMPT = list(range(1, 14))
PAGE_BYTES = 2 * 2 * 4 * 2 * 2 * 4  # layers x (K, V) x page_size x heads x head_dim x fp32 = 256


def make_manager() -> PagedKVCacheManager:
    """Two replicas of 6 device pages over 16 host pages each."""
    params = make_params(
        **LOCAL,
        n_kv_heads=2,
        head_dim=2,
        num_layers=2,
        devices=[CPU, CPU],
        data_parallel_degree=2,
        commit_on_alloc=False,
    )
    return PagedKVCacheManager(params, None, 6, total_num_host_pages=16, max_batch_size=2, enable_runtime_checks=True)


def scripted_run(mgr: PagedKVCacheManager) -> None:
    """Replica 0: a (13 + 3 tokens), b (shares 8), an evictor that takes the whole pool, c (a's prefix back
    from host). Replica 1: d (13 tokens) runs one step and keeps its pages."""
    model = PrefixStampModel(mgr)

    def run(c: Any, new_tokens: int, r: int = 0, release: bool = True) -> None:
        mgr.claim(c.request_id, r)
        for t in range(new_tokens):
            batches: list[list[Any]] = [[], []]
            batches[r] = [c]
            mgr.alloc(c, r)
            model.forward(batches)
            c.update(100 + t)
            mgr.step(batches)
        if release:
            mgr.release(c.request_id, r)

    run(ctx("a", PROMPT), 4)
    run(ctx("b", PROMPT[:8] + [77, 78, 79, 80, 81]), 2)
    run(ctx("evictor", range(50, 70)), 2)
    run(ctx("c", PROMPT + [99]), 2)
    run(ctx("d", PROMPT), 1, r=1, release=False)


def scrape(registry: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the text exposition, by (name, labels)."""
    text = prometheus_client.generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_collector_reports_exact_values_after_a_scripted_run() -> None:
    mgr = make_manager()
    try:
        scripted_run(mgr)
        registry = prometheus_client.CollectorRegistry()
        registry.register(PagedKVCollector(mgr))
        s = scrape(registry)
        pages = {(kind, tier, r): sample(s, f"pagedkv_pages_{kind}", tier=tier, replica=r)
                 for kind in ("used", "free", "cached", "capacity") for tier in ("device", "host") for r in "01"}  # fmt: skip
        assert pages == {
            ("used", "device", "0"): 0, ("free", "device", "0"): 6, ("cached", "device", "0"): 5,
            ("capacity", "device", "0"): 6, ("used", "host", "0"): 10, ("free", "host", "0"): 6,
            ("cached", "host", "0"): 10, ("capacity", "host", "0"): 16,
            ("used", "device", "1"): 4, ("free", "device", "1"): 2, ("cached", "device", "1"): 3,
            ("capacity", "device", "1"): 6, ("used", "host", "1"): 0, ("free", "host", "1"): 16,
            ("cached", "host", "1"): 0, ("capacity", "host", "1"): 16,
        }  # fmt: skip
        # replica 0 asked for 16 + 6 + 21 + 3 computed tokens plus 8 (b) + 12 (c) cached ones
        assert sample(s, "pagedkv_prefix_cache_queries_total", replica="0") == 66
        assert sample(s, "pagedkv_prefix_cache_hits_total", replica="0") == 20
        assert sample(s, "pagedkv_prefix_cache_queries_total", replica="1") == 13
        assert sample(s, "pagedkv_hit_rate", tier="device", replica="0") == 20 / 66
        assert sample(s, "pagedkv_evictions_total", tier="device", replica="0") == 8
        assert sample(s, "pagedkv_evictions_total", tier="host", replica="0") == 0
        host0 = dict(tier="host", replica="0")
        assert sample(s, "pagedkv_tier_hits_total", **host0) == 3  # c's three pages
        assert sample(s, "pagedkv_tier_lookups_total", **host0) == mgr.tier_stats(0)["host"]["lookups"]
        assert sample(s, "pagedkv_hit_rate", **host0) == 3 / mgr.tier_stats(0)["host"]["lookups"]
        assert sample(s, "pagedkv_tier_transfer_pages_total", direction="store", **host0) == 10  # 3 + 1 + 1 + 5
        assert sample(s, "pagedkv_tier_transfer_pages_total", direction="load", **host0) == 3
        assert sample(s, "pagedkv_tier_transfer_bytes_total", direction="store", **host0) == 10 * PAGE_BYTES
        assert sample(s, "pagedkv_tier_transfer_bytes_total", direction="load", **host0) == 3 * PAGE_BYTES
        for name in ("errors", "refused", "skipped_writes"):
            assert sample(s, f"pagedkv_tier_{name}_total", **host0) == 0
        # latency histograms: one observation per batch operation (4 offloads, 1 load), cumulative buckets
        for direction, count in (("store", 4), ("load", 1)):
            labels = dict(direction=direction, **host0)
            assert sample(s, "pagedkv_tier_transfer_latency_seconds_count", **labels) == count
            buckets = [sample(s, "pagedkv_tier_transfer_latency_seconds_bucket", le=le, **labels)
                       for le in [*(prometheus_client.utils.floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]]  # fmt: skip
            assert buckets == sorted(buckets) and buckets[-1] == count
            assert sample(s, "pagedkv_tier_transfer_latency_seconds_sum", **labels) > 0
        host1 = dict(tier="host", replica="1")
        assert sample(s, "pagedkv_tier_transfer_latency_seconds_count", direction="store", **host1) == 0
        assert sample(s, "pagedkv_tier_lookups_total", **host1) == 3  # d's three full pages missed
        assert not any(name.startswith("pagedkv_kv_events") for name, _ in s)  # no publisher attached
    finally:
        mgr.close()


def test_publisher_counters_are_exported() -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from pagedkv.observability import ZmqEventPublisher

    mgr = make_manager()
    pub = ZmqEventPublisher("inproc://pagedkv-metrics-test")
    batches: list[Any] = []
    try:
        mgr.add_kv_event_listener(batches.append)
        mgr.add_kv_event_listener(pub)
        scripted_run(mgr)
        pub.close()
        registry = prometheus_client.CollectorRegistry()
        registry.register(PagedKVCollector(mgr))  # finds the publisher among the listeners
        s = scrape(registry)
        endpoint = "inproc://pagedkv-metrics-test"
        assert len(batches) == 9
        assert sample(s, "pagedkv_kv_events_published_total", endpoint=endpoint) == 9
        assert sample(s, "pagedkv_kv_events_dropped_total", endpoint=endpoint) == 0
        assert sample(s, "pagedkv_kv_events_errors_total", endpoint=endpoint) == 0
    finally:
        pub.close()
        mgr.close()


def test_metrics_server_answers_a_real_scrape() -> None:
    mgr = make_manager()
    server = start_metrics_server(mgr, port=0, addr="127.0.0.1")
    try:
        scripted_run(mgr)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            assert response.status == 200
            body = response.read().decode()
        lines = set(body.splitlines())
        assert 'pagedkv_pages_capacity{replica="0",tier="device"} 6.0' in lines
        assert 'pagedkv_pages_used{replica="1",tier="device"} 4.0' in lines
        assert 'pagedkv_tier_transfer_pages_total{direction="store",replica="0",tier="host"} 10.0' in lines
        assert 'pagedkv_evictions_total{replica="0",tier="device"} 8.0' in lines
        assert not any(line.startswith("python_gc") for line in lines)  # its own registry, not the default
    finally:
        server.close()
        mgr.close()
