"""The threading model (README, "Threading model") under load.

- A manager belongs to one thread, its scheduler's; the main thread plays that scheduler here.
- Its connector moves pages on its own I/O threads while the scheduler runs.
- Tier objects are thread-safe: other threads read and write pages through the very `DiskTier` and
  `RedisTier` the scheduler's connector uses, and other managers (one per thread, like engines in
  other processes) share the directory and the server.
- Statistics and Prometheus collection may run on any thread.

Every forward of every manager runs under `PrefixStampModel` (each cached position read holds its own
prefix's KV), `check_integrity()` runs after each step, and every row another thread fetches must
equal the bytes a single-threaded fetch of the same key returned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import make_params
from offload.redis_server import RedisServer
from pagedkv.core.context import TextContext
from pagedkv.core.hashing import hash_tokens
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import PrefixStampModel

PREFIXES = [list(range(1 + 50 * g, 41 + 50 * g)) for g in range(4)]  # 4 shared 40-token prefixes
SECONDS_OF_SCHEDULING = 60  # a bound, not a target: the scheduler stops after its requests


def _manager(kind: str, where: str) -> PagedKVCacheManager:
    if kind == "disk":
        cfg = KVConnectorConfig(disk_offload_dir=where, io_threads=4)
        extra: dict[str, Any] = dict(kv_connector="tiered", host_kvcache_swap_space_gb=0.0002)
    else:
        cfg = KVConnectorConfig(redis_url=where, redis_key_prefix="conc:", io_threads=4, redis_timeout_s=5.0)
        extra = dict(kv_connector="redis")
    params = make_params(n_kv_heads=2, head_dim=4, num_layers=2, page_size=4, enable_prefix_caching=True,
                         kv_connector_config=cfg, **extra)  # fmt: skip
    return PagedKVCacheManager(params, None, 64, max_batch_size=8, enable_runtime_checks=True)


def _schedule(mgr: PagedKVCacheManager, seed: int, requests: int) -> int:
    """Serve `requests` prompts (a shared prefix + a random suffix), four at a time, under the stamp model;
    the device holds 64 pages, so pages keep leaving for the tier and coming back. Returns positions checked."""
    rng = np.random.default_rng(seed)
    model = PrefixStampModel(mgr)
    for first in range(0, requests, 4):
        batch = []
        for rid in range(first, first + 4):
            prompt = (
                PREFIXES[int(rng.integers(len(PREFIXES)))] + rng.integers(200, 300, int(rng.integers(1, 9))).tolist()
            )
            batch.append(TextContext(rid, np.asarray(prompt)))
            mgr.claim(rid)
        for t in range(3):
            for c in batch:
                mgr.alloc(c)
            model.forward([batch])
            for c in batch:
                c.update(1000 + t)
            mgr.step([batch])
        for c in batch:
            mgr.release(c.request_id)
    mgr.sync_tiers()
    mgr.check_integrity()
    assert mgr.get_num_used_pages() == 0
    return model.positions_checked


class Workers:
    """Threads running `fn` until told to stop; the first exception of any of them is kept."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.rounds: dict[str, int] = {}

    def start(self, name: str, fn: Callable[[], None], loop: bool = True) -> None:
        def run() -> None:
            try:
                while True:
                    fn()
                    self.rounds[name] = self.rounds.get(name, 0) + 1
                    if not loop or self.stop.is_set():
                        return
            except BaseException as exc:  # noqa: BLE001 - reported by join()
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=SECONDS_OF_SCHEDULING)
        assert not any(t.is_alive() for t in self.threads), "a worker thread hung"
        if self.errors:
            raise self.errors[0]


def _tier_hammer(mgr: PagedKVCacheManager, seed: int) -> Callable[[], None]:
    """fetch a prefix's pages through the scheduler's own tier object, store them back under their keys,
    and check every fetched row against the first fetch of that key (pages never change under a key)."""
    tier = mgr.tiers.connectors[0].lower[0]
    rng = np.random.default_rng(seed)
    seen: dict[bytes, bytes] = {}
    lock = threading.Lock()

    def once() -> None:
        prefix = PREFIXES[int(rng.integers(len(PREFIXES)))]
        keys = hash_tokens(prefix + [0], 4, seed=mgr.params.kv_hash_seed)
        rows = torch.zeros((len(keys), tier.row_bytes), dtype=torch.uint8)  # [pages, row bytes]
        views = [memoryview(r.numpy()) for r in rows]
        got = tier.fetch(keys, views)
        with lock:
            for key, row in zip(keys[:got], rows[:got], strict=True):
                assert seen.setdefault(key, row.numpy().tobytes()) == row.numpy().tobytes(), "a page changed"
        tier.store(keys[:got], views[:got], lambda i: None)
        tier.wait()

    return once


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_transfers_from_many_threads_while_the_scheduler_runs(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = str(tmp_path)
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.client().flushall()
        where = server.url
    main = _manager(kind, where)
    assert _schedule(main, 0, 8) > 0  # warm the tier, single-threaded
    others = [_manager(kind, where) for _ in range(3)]
    checked: dict[int, int] = {}
    workers = Workers()
    for i, other in enumerate(others):  # engines on other threads, sharing the tier
        workers.start(f"engine-{i}", lambda i=i, m=other: checked.__setitem__(i, _schedule(m, 10 + i, 24)), False)
    for i in range(2):  # raw transfers through the main manager's own tier object
        workers.start(f"tier-{i}", _tier_hammer(main, 20 + i))
    workers.start("stats", lambda: (main.tier_stats(), main.get_metrics(), [o.tier_stats() for o in others]))
    if kind == "disk":
        from prometheus_client.core import Metric

        from pagedkv.observability.prometheus import PagedKVCollector

        collector = PagedKVCollector(main)
        workers.start("scrape", lambda: [m for m in collector.collect() if not isinstance(m, Metric)] and None)
    main_checked = _schedule(main, 1, 48)  # the scheduler thread
    workers.join()
    assert main_checked > 0 and len(checked) == 3 and all(v > 0 for v in checked.values())
    assert min(workers.rounds.get(f"tier-{i}", 0) for i in range(2)) >= 1
    loaded = sum(m.tier_stats()[kind]["pages_loaded"] for m in [main, *others])
    stats = [m.tier_stats()[kind] for m in [main, *others]]
    assert loaded > 0 and all(s["errors"] == 0 and s["refused"] == 0 for s in stats), stats
    for m in [main, *others]:
        m.check_integrity()
        m.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with RedisServer.running(tmp_path_factory.mktemp("redis")) as server:
        yield server
