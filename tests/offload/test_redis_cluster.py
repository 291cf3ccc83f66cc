"""Redis tier against a real 3-primary Redis Cluster (``redis+cluster://``): bit-exact round trips, pages
spread over the nodes, refused values, reset on every node, and a node that dies mid-run and comes back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_cluster import RedisCluster
from redis_server import free_port
from test_host_tier import keys, pages, scramble
from test_redis_tier import PROMPT, config, connector, engine_process, manager, wait_available

from pagedkv.core.hashing import hash_tokens
from pagedkv.offload.format import HEADER_SIZE
from pagedkv.offload.redis_tier import RedisTier
from pagedkv.params.connector import KVConnectorConfig

NAMES = "abcdefghij"


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One cluster for the tests that leave it running (each uses its own key prefix)."""
    with RedisCluster.running(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    with RedisCluster.running(tmp_path) as running:
        yield running


def per_node(cluster: RedisCluster, prefix: str) -> list[list[bytes]]:
    """The keys under `prefix` on each node, asked with a plain client per node."""
    return [sorted(client.keys(f"{prefix}*")) for client in cluster.clients()]


@pytest.mark.parametrize("layout", ["fp32", "tree"])
def test_round_trip_is_bit_exact_spread_over_nodes_and_reset_everywhere(
    shared_cluster: RedisCluster, layout: str
) -> None:
    prefix = f"rt-{layout}:"
    mgr = manager(config(shared_cluster.url, redis_key_prefix=prefix), layout)
    conn = connector(mgr)
    tier = conn.lower[0]
    assert isinstance(tier, RedisTier) and tier.cluster and type(tier.client).__name__ == "RedisCluster"
    scramble(mgr, 1)
    before = pages(mgr, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    conn.offload(list(range(10)), keys(*NAMES))
    conn.flush()
    scramble(mgr, 2)
    assert conn.load(list(range(10)), keys(*NAMES)) == 10
    assert conn.complete_loads() == 10  # `load` only staged the copies
    assert pages(mgr, list(range(10))) == before
    assert conn.load([5, 6], keys("a", "x")) == 1
    stats = mgr.tier_stats()["redis"]
    assert (stats["pages_stored"], stats["pages_loaded"], stats["errors"]) == (10, 11, 0)
    nodes = per_node(shared_cluster, prefix)
    assert sorted(n for node in nodes for n in node) == sorted(tier.key(k).encode() for k in keys(*NAMES))
    assert sum(1 for node in nodes if node) >= 2, nodes  # no hash tag: the pages spread over the primaries
    conn.offload([2, 3], keys("a", "b"))  # already in the cluster: nothing is sent again
    conn.flush()
    assert mgr.tier_stats()["redis"]["pages_stored"] == 10
    assert tier.reset() == 10  # SCAN + UNLINK on every primary
    assert per_node(shared_cluster, prefix) == [[], [], []]
    assert conn.load([7], keys("a")) == 0
    mgr.close()


def test_engines_share_pages_and_a_corrupted_value_is_refused(shared_cluster: RedisCluster) -> None:
    cfg = config(shared_cluster.url, redis_key_prefix="corrupt:", redis_ttl_s=100)
    first = engine_process(cfg)
    assert (first["cached"], first["pages_stored"], first["errors"]) == (0, 8, 0)
    assert sum(1 for node in per_node(shared_cluster, "corrupt:") if node) >= 2
    assert engine_process(cfg)["cached"] == 28  # a second engine reads the first one's pages
    key = hash_tokens(PROMPT + [1000, 1001, 1002, 1003], 4)[2]
    assert isinstance(key, bytes)
    [(raw, name)] = [(c, n) for c in shared_cluster.clients() for n in c.keys(f"corrupt:*:{key.hex()}")]
    good = raw.get(name)
    assert 99 <= raw.ttl(name) <= 100
    raw.setrange(name, HEADER_SIZE + 100, bytes([good[HEADER_SIZE + 100] ^ 0xFF]))  # one payload byte
    second = engine_process(cfg)
    assert second["cached"] == 8 and second["checked"] >= 8  # pages 0-1 from the cluster, 2 refused
    assert (second["refused"], second["pages_loaded"], second["pages_stored"], second["errors"]) == (1, 2, 1, 0)
    assert raw.get(name) == good  # deleted, then written again by the recompute
    third = engine_process(cfg)
    assert (third["cached"], third["refused"], third["pages_loaded"]) == (28, 0, 7)


def test_node_down_is_a_counted_miss_that_never_raises_then_recovers(cluster: RedisCluster) -> None:
    mgr = manager(config(cluster.url, redis_retry_s=0.5))
    conn = connector(mgr)
    tier = conn.lower[0]
    conn.offload(list(range(10)), keys(*NAMES))
    conn.flush()
    nodes = per_node(cluster, "t:")
    assert sum(len(node) for node in nodes) == 10
    dead = max(range(3), key=lambda i: len(nodes[i]))  # kill the node holding the most pages
    cluster.stop(dead)
    start = time.monotonic()
    assert conn.load(list(range(10)), keys(*NAMES)) == 0  # one node unreachable: the whole read is a miss
    assert time.monotonic() - start < 0.5  # refused at once, no retry
    conn.offload([0], keys("z"))  # skipped while down
    conn.flush()
    assert tier.reset() == 0
    stats = mgr.tier_stats()["redis"]
    assert (stats["errors"], stats["skipped_writes"], stats["pages_stored"]) == (1, 1, 10)
    wait_available(tier)
    assert conn.load(list(range(10)), keys(*NAMES)) == 0  # tried again after redis_retry_s: still down
    assert mgr.tier_stats()["redis"]["errors"] == 2
    wait_available(tier)
    conn.offload(list(range(10)), keys(*NAMES.upper()))  # a write that reaches the dead node fails
    conn.flush()
    after: dict[str, Any] = mgr.tier_stats()["redis"]
    assert after["errors"] >= 3 and after["skipped_writes"] >= 2  # each io thread's job fails or is skipped
    cluster.restart(dead)  # back with its slots, empty: the other nodes' pages are still there
    wait_available(tier)
    conn.offload(list(range(10)), keys(*NAMES))
    conn.flush()
    assert conn.load(list(range(10)), keys(*NAMES)) == 10
    assert sum(len(node) for node in per_node(cluster, "t:")) >= 10
    start = time.monotonic()
    mgr.close()
    assert time.monotonic() - start < 0.5


def test_unreachable_cluster_at_startup_is_an_error_not_a_crash() -> None:
    mgr = manager(config(f"redis+cluster://127.0.0.1:{free_port()}", redis_retry_s=0.3))
    conn = connector(mgr)
    assert conn.load([1], keys("a")) == 0  # building the client (node discovery) fails: counted, a miss
    conn.offload([2], keys("a"))
    conn.flush()
    stats = mgr.tier_stats()["redis"]
    assert (stats["errors"], stats["skipped_writes"]) == (1, 1)
    wait_available(conn.lower[0])
    assert conn.load([1], keys("a")) == 0 and mgr.tier_stats()["redis"]["errors"] == 2
    mgr.close()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(redis_url="redis+cluster://127.0.0.1:1/3"), "only database 0"),
        (dict(redis_url="redis+cluster://127.0.0.1:1", redis_ssl_ca_certs="ca.pem"), "need a rediss:// redis_url"),
        (dict(redis_url="valkey+cluster://127.0.0.1:1"), "redis\\+cluster:// or rediss\\+cluster://"),
    ],
)
def test_cluster_url_is_checked_at_construction(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RedisTier(KVConnectorConfig(**overrides), 512, bytes(16), "sha256")


def test_tls_cluster_url_builds_tls_connections() -> None:
    cfg = KVConnectorConfig(redis_url="rediss+cluster://u:p@127.0.0.1:1", redis_ssl_ca_certs="ca.pem")
    tier = RedisTier(cfg, 512, bytes(16), "sha256")
    assert tier.cluster and tier._client is None  # connects on first use
    from pagedkv.offload.redis_client import client_factory

    factory = client_factory(cfg)
    assert factory.func.__qualname__ == "RedisCluster.from_url" and factory.args == ("rediss://127.0.0.1:1",)
    options = factory.keywords  # the URL's credentials go as arguments, TLS files and timeouts too
    assert (options["ssl_ca_certs"], options["username"], options["password"]) == ("ca.pem", "u", "p")
    assert options["socket_connect_timeout"] == options["socket_timeout"] == cfg.redis_timeout_s
    tier.shutdown()
