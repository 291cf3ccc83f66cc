"""Redis tier against a real redis-server: bit-exact round trips for every layout, refused values,
layout and prefix isolation, TTL, password and ACL auth, and a server that dies, hangs and comes back."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer
from test_host_tier import keys, pages, scramble
from tier_worker import serve

from helpers import make_params
from pagedkv.core.events import BlockRemoved
from pagedkv.core.hashing import hash_tokens
from pagedkv.dtype import DeviceRef, DType
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.offload.connector import KVConnector
from pagedkv.offload.format import HEADER_SIZE
from pagedkv.params import KVCacheQuantizationConfig
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.params.multi import MultiKVCacheParams
from pagedkv.testing import PrefixStampModel

CPU = DeviceRef.CPU()
SMALL = dict(n_kv_heads=2, head_dim=4, num_layers=2)
LAYOUTS = {
    "fp32": lambda c: make_params(**c, **SMALL),
    "bf16": lambda c: make_params(**c, **SMALL, dtype=DType.bfloat16),
    "fp8-scales": lambda c: make_params(**c, dtype=DType.float8_e4m3fn, n_kv_heads=2, head_dim=8, num_layers=2,
                                        kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=4)),
    "mha-tp2": lambda c: make_params(**c, **SMALL, devices=[CPU, CPU]),
    "mla-tp2": lambda c: make_params(**c, n_kv_heads=1, head_dim=6, num_layers=2, devices=[CPU, CPU], is_mla=True,
                                     num_q_heads=4),
    "tree": lambda c: MultiKVCacheParams({
        "target": make_params(**c, **SMALL),
        "draft": make_params(**c, dtype=DType.bfloat16, n_kv_heads=1, head_dim=8, num_layers=1),
    }),
}  # fmt: skip
PROMPT = list(range(1, 30))  # 29 tokens, pages of 4: 7 shareable prompt pages; 8 pages stored with 4 new tokens
ROW = 2 * 2 * 4 * 2 * 4 * 4  # fp32 row: K/V x layers x page x heads x head_dim x 4 bytes = 512


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.running(tmp_path) as server:
        yield server


def config(url: str, **overrides: Any) -> KVConnectorConfig:
    return KVConnectorConfig(**{"redis_url": url, "redis_key_prefix": "t:", "redis_retry_s": 0.5,
                                "redis_timeout_s": 0.3, **overrides})  # fmt: skip


def manager(cfg: KVConnectorConfig, layout: str = "fp32", host_pages: int = 0) -> PagedKVCacheManager:
    params = LAYOUTS[layout](dict(enable_prefix_caching=True, kv_connector="redis", kv_connector_config=cfg))
    return PagedKVCacheManager(params, None, 10, total_num_host_pages=host_pages, max_batch_size=4)


def connector(mgr: PagedKVCacheManager) -> KVConnector:
    conn: KVConnector = mgr.tiers.connectors[0]
    return conn


def engine_process(cfg: KVConnectorConfig, events: list[Any] | None = None) -> dict[str, Any]:
    """One fresh "engine" (empty device, no host tier) serves PROMPT under PrefixStampModel, which checks
    the KV of every cached position; returns cached tokens and the Redis counters."""
    mgr = PagedKVCacheManager(make_params(**SMALL, enable_prefix_caching=True, kv_connector="redis",
                                          kv_connector_config=cfg), None, 8, max_batch_size=4, enable_runtime_checks=True)  # fmt: skip
    if events is not None:
        mgr.add_kv_event_listener(lambda batch: events.extend(e for e in batch.events if isinstance(e, BlockRemoved)))
    model = PrefixStampModel(mgr)
    cached = serve(mgr, model, 0, PROMPT, 4)  # generates tokens 1000..1003
    mgr.sync_tiers()
    report = {"cached": cached, "checked": model.positions_checked, **mgr.tier_stats()["redis"]}
    mgr.close()
    return report


def page_name(server: RedisServer, index: int, prefix: str = "t:") -> bytes:
    key = hash_tokens(PROMPT + [1000, 1001, 1002, 1003], 4)[index]
    [name] = server.client().keys(f"{prefix}*:{key.hex()}")
    return bytes(name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(redis_server: RedisServer, layout: str) -> None:
    mgr = manager(config(redis_server.url), layout)
    conn = connector(mgr)
    assert conn.host is None and [t.name for t in conn.lower] == ["redis"]
    scramble(mgr, 1)
    before = pages(mgr, [2, 3, 4])
    conn.offload([2, 3, 4], keys("a", "b", "c"))
    conn.flush()
    scramble(mgr, 2)
    assert conn.load([7, 8, 9], keys("a", "b", "c")) == 3
    assert conn.complete_loads() == 3  # `load` only staged the copies
    assert pages(mgr, [7, 8, 9]) == before
    assert conn.load([5, 6], keys("a", "x")) == 1 and conn.load([5], keys("x")) == 0
    stats = mgr.tier_stats()["redis"]
    row = conn.mover.row_bytes
    assert (stats["pages_stored"], stats["bytes_stored"], stats["pages_loaded"], stats["lookups"]) == (3, 3 * row, 4, 6)
    raw = redis_server.client()
    assert sorted(raw.keys("*")) == sorted(f"t:{conn.lower[0].fingerprint.hex()}:{k.hex()}".encode()
                                           for k in keys("a", "b", "c"))  # fmt: skip
    assert {len(raw.get(n)) for n in raw.keys("*")} == {HEADER_SIZE + row} and raw.ttl(raw.keys("*")[0]) == -1
    conn.offload([2, 3], keys("a", "b"))  # already on the server: nothing is sent again
    conn.flush()
    assert mgr.tier_stats()["redis"]["pages_stored"] == 3
    mgr.close()


def test_host_tier_in_front_promotes_redis_hits(redis_server: RedisServer) -> None:
    mgr = manager(config(redis_server.url), host_pages=6)
    conn = connector(mgr)
    assert conn.host is not None
    scramble(mgr, 1)
    before = pages(mgr, [2, 3])
    conn.offload([2, 3], keys("a", "b"))
    conn.flush()
    conn.host.index.clear()  # host forgets: the pages must come from Redis
    scramble(mgr, 2)
    assert conn.load([7, 8], keys("a", "b")) == 2 and conn.complete_loads() == 2 and pages(mgr, [7, 8]) == before
    assert conn.load([5, 6], keys("a", "b")) == 2  # now host hits
    redis, host = mgr.tier_stats()["redis"], mgr.tier_stats()["host"]
    assert (redis["pages_stored"], redis["pages_loaded"], redis["lookups"]) == (2, 2, 2)
    assert (host["pages_stored"], host["pages_loaded"]) == (4, 2)  # 2 offloaded + 2 promoted
    mgr.close()


def test_corrupted_value_is_refused_kept_and_written_over(redis_server: RedisServer) -> None:
    cfg = config(redis_server.url)
    first = engine_process(cfg)
    assert first["cached"] == 0 and first["pages_stored"] == 8
    raw, name = redis_server.client(), page_name(redis_server, 2)
    good = raw.get(name)
    raw.setrange(name, HEADER_SIZE + 100, bytes([good[HEADER_SIZE + 100] ^ 0xFF]))  # one payload byte
    events: list[Any] = []
    second = engine_process(cfg, events)
    assert second["cached"] == 8 and second["checked"] >= 8  # pages 0-1 from Redis, 2 refused, the rest recomputed
    assert (second["refused"], second["pages_loaded"], second["pages_stored"], second["errors"]) == (1, 2, 1, 0)
    assert [e for e in events if e.medium == "REDIS"] == []  # the reader deletes nothing
    assert raw.get(name) == good  # the recompute wrote over the value it refused
    third = engine_process(cfg)
    assert (third["cached"], third["refused"], third["pages_loaded"]) == (28, 0, 7)


def test_other_model_or_layout_misses(redis_server: RedisServer) -> None:
    raw = redis_server.client()
    engine_process(config(redis_server.url, model_id="model-a"))
    a_name = page_name(redis_server, 0)
    other = engine_process(config(redis_server.url, model_id="model-b"))
    assert (other["cached"], other["pages_loaded"], other["refused"], other["pages_stored"]) == (0, 0, 0, 8)
    assert len(raw.keys("*")) == 16 and len({n.split(b":")[1] for n in raw.keys("*")}) == 2  # two fingerprints
    [b_name] = set(raw.keys(b"t:*:" + a_name.split(b":")[-1])) - {a_name}
    value_a, value_b = raw.get(a_name), raw.get(b_name)  # swap page 0: each header names the other layout
    raw.set(a_name, value_b)
    raw.set(b_name, value_a)
    again = engine_process(config(redis_server.url, model_id="model-b"))
    assert (again["cached"], again["refused"], again["pages_loaded"]) == (0, 1, 0)


def test_key_prefix_isolation_and_reset(redis_server: RedisServer) -> None:
    engine_process(config(redis_server.url, redis_key_prefix="a*"))  # a glob character, matched literally
    other = engine_process(config(redis_server.url, redis_key_prefix="ab"))
    assert (other["cached"], other["pages_loaded"], other["pages_stored"]) == (0, 0, 8)
    raw = redis_server.client()
    assert sorted({n[:2] for n in raw.keys("*")}) == [b"a*", b"ab"]
    mgr = manager(config(redis_server.url, redis_key_prefix="a*"))
    assert connector(mgr).lower[0].reset() == 8
    assert {n[:2] for n in raw.keys("*")} == {b"ab"} and len(raw.keys("*")) == 8
    mgr.reset_prefix_cache()  # the manager's reset reaches Redis too: nothing left of "a*"
    assert len(raw.keys("*")) == 8
    mgr.close()
    assert engine_process(config(redis_server.url, redis_key_prefix="ab"))["cached"] == 28


def test_ttl_is_set_and_refreshed(redis_server: RedisServer) -> None:
    mgr = manager(config(redis_server.url, redis_ttl_s=100))
    conn = connector(mgr)
    conn.offload([2], keys("a"))
    conn.flush()
    raw = redis_server.client()
    [name] = raw.keys("*")
    assert 99 <= raw.ttl(name) <= 100
    raw.expire(name, 5)
    conn.offload([2], keys("a"))  # offered again: not rewritten, but kept for another ttl
    conn.flush()
    assert 99 <= raw.ttl(name) <= 100 and mgr.tier_stats()["redis"]["pages_stored"] == 1
    mgr.close()


def test_password_auth(tmp_path: Path) -> None:
    with RedisServer.running(tmp_path, "--requirepass", "s3cret") as server:
        ok = engine_process(config(server.url, redis_password="s3cret"))
        assert (ok["pages_stored"], ok["errors"]) == (8, 0)
        url = server.url.replace("redis://", "redis://:s3cret@")  # the password in the URL works too
        assert engine_process(config(url))["cached"] == 28
        wrong = engine_process(config(url, redis_password="wrong"))  # the config's password wins over the URL's
        assert (wrong["cached"], wrong["pages_loaded"], wrong["errors"], wrong["pages_stored"]) == (0, 0, 1, 0)
        assert wrong["skipped_writes"] == 8


def test_acl_user_auth(tmp_path: Path) -> None:
    acl = ("--user", "alice", "on", ">wonderland", "~acl:*", "+@all", "--user", "default", "off")
    with RedisServer.running(tmp_path, *acl) as server:
        alice = config(server.url, redis_username="alice", redis_password="wonderland", redis_key_prefix="acl:")
        assert engine_process(alice)["pages_stored"] == 8
        assert engine_process(alice)["cached"] == 28
        url = server.url.replace("redis://", "redis://alice:wonderland@")
        assert engine_process(config(url, redis_key_prefix="acl:"))["cached"] == 28
        denied = engine_process(config(url, redis_key_prefix="other:"))  # NOPERM: a ResponseError, not an outage
        assert (denied["cached"], denied["errors"], denied["pages_stored"]) == (0, 1, 0)


def test_unix_socket_with_password_in_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with RedisServer.running(tmp_path, "--unixsocket", str(sock), "--requirepass", "pw"):
        url = f"unix://:pw@{sock}?db=0"
        assert engine_process(config(url))["pages_stored"] == 8
        assert engine_process(config(url))["cached"] == 28


def test_tls_with_client_certificate(tmp_path: Path) -> None:
    with RedisServer.running(tmp_path, tls=True) as server:
        files = dict(redis_ssl_ca_certs=str(server.cert), redis_ssl_certfile=str(server.cert),
                     redis_ssl_keyfile=str(server.key))  # fmt: skip
        assert engine_process(config(server.url, **files))["pages_stored"] == 8
        assert engine_process(config(server.url, **files))["cached"] == 28
        no_cert = engine_process(config(server.url, redis_ssl_ca_certs=str(server.cert)))  # the server wants one
        assert (no_cert["cached"], no_cert["errors"], no_cert["pages_stored"]) == (0, 1, 0)
    with pytest.raises(ValueError, match="need a rediss:// redis_url"):
        manager(config("redis://127.0.0.1:1/0", redis_ssl_ca_certs=str(server.cert)))


def wait_available(tier: Any) -> None:
    while not tier.available:
        time.sleep(0.02)


def test_dead_server_is_a_quick_miss_logged_once_then_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = manager(config(redis_server.url, redis_retry_s=0.5))
    conn = connector(mgr)
    tier = conn.lower[0]
    conn.offload([2, 3], keys("a", "b"))
    conn.flush()
    caplog.set_level(logging.WARNING, logger="pagedkv.offload.redis")
    redis_server.stop()
    start = time.monotonic()
    assert conn.load([7, 8], keys("a", "b")) == 0
    assert time.monotonic() - start < 0.5  # refused at once: no retry (redis-py's default retries take 2 s+)
    conn.offload([4], keys("c"))  # the tier is down: skipped without a network call
    conn.flush()
    assert conn.load([7], keys("a")) == 0
    stats = mgr.tier_stats()["redis"]
    assert (stats["errors"], stats["skipped_writes"], stats["pages_stored"]) == (1, 1, 2)
    wait_available(tier)
    assert conn.load([7], keys("a")) == 0  # tried again after redis_retry_s: still dead
    assert mgr.tier_stats()["redis"]["errors"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0] and "skipped for 0.5s" in warnings[0]
    redis_server.start()  # same port, empty (no persistence)
    wait_available(tier)
    conn.offload([2], keys("a"))
    conn.flush()
    assert conn.load([7, 8], keys("a", "b")) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "answers again" in warnings[1]
    stats = mgr.tier_stats()["redis"]
    assert (stats["errors"], stats["pages_stored"], stats["pages_loaded"]) == (2, 3, 1)
    redis_server.stop()
    start = time.monotonic()
    mgr.close()  # nothing pending; the dead server does not delay shutdown
    assert time.monotonic() - start < 0.5


def test_hung_server_times_out_and_shutdown_does_not_hang(redis_server: RedisServer) -> None:
    mgr = manager(config(redis_server.url, redis_timeout_s=0.3, redis_retry_s=30))
    conn = connector(mgr)
    stats = conn.lower[0].stats
    conn.offload([2], keys("a"))
    conn.flush()
    redis_server.pause()  # accepts connections, never answers
    try:
        start = time.monotonic()
        assert conn.load([7], keys("a")) == 0
        assert 0.25 < time.monotonic() - start < 1.5  # one socket timeout, no retry
        conn.offload([3, 4], keys("b", "c"))  # down for 30 s: skipped at once
        start = time.monotonic()
        mgr.close()
        assert time.monotonic() - start < 0.5
        assert (stats.errors, stats.skipped_writes, stats.pages_stored) == (1, 2, 1)
    finally:
        redis_server.resume()


def test_import_is_lazy_and_missing_redis_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys, pagedkv, pagedkv.offload.redis_tier; assert 'redis' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    from pagedkv.offload.redis_tier import RedisTier

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install 'pagedkv\[tiers\]'"):
        RedisTier(config("redis://127.0.0.1:1"), 512, bytes(16), "sha256")
