"""Connections of the Redis tier: one server (`redis.Redis`) or a Redis Cluster (`redis.cluster.RedisCluster`).

`redis_url` picks the kind:

    redis://[user:password@]host:port/db     one server (rediss:// TLS, unix:///path.sock a socket)
    redis+cluster://[user:password@]host:port  a Redis Cluster (rediss+cluster:// TLS); the URL names one
                                              startup node, the client discovers the others and their slots

In cluster mode every page key hashes to its own slot (no hash tags), so the pages of one prefix spread
over all primaries; the tier uses the client's non-atomic multi-key operations (``mget_nonatomic``,
per-node pipelines). redis-py is imported only here, and only when a tier is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any
from urllib.parse import unquote, urlsplit

from pagedkv.params.connector import KVConnectorConfig, cluster_node

__all__ = ["CLUSTER_SCHEMES", "client_factory", "import_redis", "is_cluster", "redis_client", "unlink_prefix", "where"]

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # -> the scheme redis-py parses


def import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        hint = "kv_connector='redis' needs the redis package (redis-py): pip install 'pagedkv[tiers]'"
        raise ImportError(hint) from exc
    return redis


def _unquote(part: str | None) -> str | None:
    return unquote(part) if part else None


def is_cluster(url: str | None) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    return url is not None and urlsplit(url).scheme in CLUSTER_SCHEMES


def where(url: str | None) -> str:
    """The server of `url` for log lines (never its credentials)."""
    parts = urlsplit(url or "")
    if parts.scheme == "unix":
        return parts.path
    node = f"{parts.hostname}:{parts.port or 6379}"
    return f"Redis Cluster (via {node})" if parts.scheme in CLUSTER_SCHEMES else node


def client_factory(config: KVConnectorConfig) -> partial[Any]:
    """Check `config` now; return ``partial(from_url, url, **options)`` that builds its client: a
    `redis.Redis` for a server URL, a `redis.cluster.RedisCluster` for a cluster URL (which connects to
    discover the nodes when built, so the tier builds it on first use). `redis_username` / `redis_password` override the URL's, the TLS
    files need a TLS URL, `redis_timeout_s` is the connect and socket timeout, and there is no
    client-side retry (the tier skips Redis for `redis_retry_s` instead)."""
    redis = import_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if config.redis_url is None:
        raise ValueError("the redis tier needs KVConnectorConfig(redis_url=...)")
    parts = urlsplit(config.redis_url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    ssl_files = {"ssl_ca_certs": config.redis_ssl_ca_certs, "ssl_certfile": config.redis_ssl_certfile,
                 "ssl_keyfile": config.redis_ssl_keyfile}  # fmt: skip
    ssl = {name: value for name, value in ssl_files.items() if value is not None}
    if ssl and scheme != "rediss":
        raise ValueError(f"redis_ssl_* files need a rediss:// redis_url, not {parts.scheme}://")
    user = config.redis_username if config.redis_username is not None else _unquote(parts.username)
    password = config.redis_password if config.redis_password is not None else _unquote(parts.password)
    rest = config.redis_url[len(parts.scheme) + 3 + len(parts.netloc) :]  # credentials go as arguments:
    url = f"{scheme}://{parts.netloc.rpartition('@')[2]}{rest}"  # the URL's would win over them
    timeouts: dict[str, float] = {"socket_timeout": config.redis_timeout_s}
    if scheme != "unix":
        timeouts["socket_connect_timeout"] = config.redis_timeout_s
    options: dict[str, Any] = dict(username=user, password=password, retry=Retry(NoBackoff(), 0), **timeouts, **ssl)
    if parts.scheme not in CLUSTER_SCHEMES:
        return partial(redis.Redis.from_url, url, **options)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"redis_url={parts.scheme}://...{parts.path}: a Redis Cluster has only database 0")
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import parse_url

    parse_url(url)  # a malformed URL fails here, not at the first use
    if config.redis_cluster_nodes:  # more startup nodes, tried after the URL's
        options["startup_nodes"] = [ClusterNode(*cluster_node(node)) for node in config.redis_cluster_nodes]
    return partial(RedisCluster.from_url, url, **options)


def redis_client(config: KVConnectorConfig) -> Any:
    """The client of `config` (see `client_factory`); a cluster client connects here."""
    return client_factory(config)()


def unlink_prefix(client: Any, prefix: str, batch: int = 512) -> Iterator[tuple[int, list[bytes]]]:
    """Delete every key that starts with `prefix` (glob characters in it are escaped): SCAN, then
    UNLINK in batches of `batch` names (a cluster client scans every primary and splits each UNLINK
    per slot). Yields, per batch, how many keys the server deleted and the names sent, so a caller
    that stops on an error knows what went before. Redis errors propagate."""
    pattern = "".join("\\" + c if c in "\\*?[]" else c for c in prefix) + "*"
    names = list(client.scan_iter(match=pattern, count=batch))
    for lo in range(0, len(names), batch):
        chunk = names[lo : lo + batch]
        yield client.unlink(*chunk), chunk
