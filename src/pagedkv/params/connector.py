"""`KVConnectorConfig`: where the tiers below the device live (`KVCacheParams.kv_connector_config`).

Pure Python, validated at construction. Which tiers run is `KVCacheParams.kv_connector`:

    null     no tier
    local    host memory (`host_kvcache_swap_space_gb`)
    tiered   host memory + a disk directory (`disk_offload_dir`), write-through
    redis    a Redis server many engines share (`redis_url`), with an optional host tier in front
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pagedkv.params.validation import check_int

__all__ = ["KVConnectorConfig", "cluster_node"]


def cluster_node(node: object) -> tuple[str, int]:
    """``"host:port"`` (``"[v6 address]:port"``) as (host, port); ValueError / TypeError naming it otherwise."""
    if not isinstance(node, str):
        raise TypeError(f"redis cluster node {node!r} must be a 'host:port' str")
    parts = urlsplit(f"//{node}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536 or parts.path or parts.username:
        raise ValueError(f"redis cluster node {node!r} must be 'host:port' with a port in 1..65535")
    return parts.hostname, port


def _check_positive(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def _check_str(name: str, value: object, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} must be a str")


def _mac_key(key: object) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes | bytearray):
        raise TypeError(f"tier_hmac_key of type {type(key).__name__} must be bytes, a str or None")
    if len(key) < 16:
        raise ValueError(f"tier_hmac_key has {len(key)} bytes; it needs at least 16")
    return bytes(key)


@dataclass(frozen=True)
class KVConnectorConfig:
    """Settings of the disk and Redis tiers (the host tier is sized by `host_kvcache_swap_space_gb`).

    Attributes:
        model_id: names the model whose KV the tiers hold. It is part of every
            stored page's layout fingerprint, so engines serving different
            models (even with the same shapes) never read each other's pages.
            Engines that should share pages must use the same value.
        disk_offload_dir: directory of the disk tier (created if missing).
        disk_offload_max_gb: size cap of the disk tier; least recently used pages
            are deleted to stay under it. The cap is the directory's: every process
            writing it (with the same layout and key) keeps it together.
        disk_timeout_s: a disk read (a batch of page files, or a lookup) that makes no
            progress for this long is abandoned: what it did not read is a miss.
        redis_url: ``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, or
            ``unix:///path/redis.sock``. ``redis+cluster://[user:password@]host:port``
            (``rediss+cluster://`` for TLS) uses a Redis Cluster: the URL names one
            startup node, the client discovers the others, and the pages spread over
            every primary (database 0 only).
        redis_cluster_nodes: more startup nodes of a cluster URL (``"host:port"`` each): the
            client tries the URL's node, then these, until one answers, and discovers the rest.
        redis_username / redis_password: ACL user and password (override the URL's).
        redis_key_prefix: prepended to every key (namespaces a shared server).
        redis_ssl_ca_certs / redis_ssl_certfile / redis_ssl_keyfile: TLS files.
        redis_ttl_s: expiry of stored pages in seconds (None: no expiry; let the
            server's ``maxmemory-policy allkeys-lru`` evict).
        redis_timeout_s: connect and socket timeout of each Redis call.
        redis_retry_s: after a Redis error, the tier is skipped for this long,
            then tried again (the engine keeps serving meanwhile).
        io_threads: threads doing disk and Redis transfers.
        tier_hmac_key: a secret of at least 16 bytes (bytes, or a str taken as UTF-8) shared by the
            engines of a deployment. Every page they write to disk or Redis is signed with
            HMAC-SHA256, and every page they read must carry a valid signature: whoever can write
            to the directory or the server but lacks the key cannot plant a page that is loaded.
            Pages live in a namespace of their key (named by the key's public id,
            `pagedkv.offload.format.key_id`), apart from unsigned pages and pages of other keys,
            so an engine with another key never reads, refuses or overwrites them. None: a
            checksum only (catches corruption, not forgery).
    """

    model_id: str = ""
    disk_offload_dir: str | None = None
    disk_offload_max_gb: float = 50.0
    disk_timeout_s: float = 5.0
    redis_url: str | None = None
    redis_cluster_nodes: tuple[str, ...] = ()
    redis_username: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    redis_key_prefix: str = "pagedkv:"
    redis_ssl_ca_certs: str | None = None
    redis_ssl_certfile: str | None = None
    redis_ssl_keyfile: str | None = None
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 1.0
    redis_retry_s: float = 5.0
    io_threads: int = 4
    tier_hmac_key: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier_hmac_key", _mac_key(self.tier_hmac_key))
        for name in ("model_id", "redis_key_prefix"):
            _check_str(name, getattr(self, name), allow_none=False)
        for name in ("disk_offload_dir", "redis_url", "redis_username", "redis_password", "redis_ssl_ca_certs",
                     "redis_ssl_certfile", "redis_ssl_keyfile"):  # fmt: skip
            _check_str(name, getattr(self, name))
        if self.disk_offload_dir == "":
            raise ValueError("disk_offload_dir='' must name a directory (or be None)")
        _check_positive("disk_offload_max_gb", self.disk_offload_max_gb)
        _check_positive("disk_timeout_s", self.disk_timeout_s)
        _check_positive("redis_timeout_s", self.redis_timeout_s)
        _check_positive("redis_retry_s", self.redis_retry_s)
        if self.redis_ttl_s is not None:
            check_int("redis_ttl_s", self.redis_ttl_s, 1)
        check_int("io_threads", self.io_threads, 1)
        schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
        if self.redis_url is not None and urlsplit(self.redis_url).scheme not in schemes:
            raise ValueError(f"redis_url={self.redis_url!r} must start with redis://, rediss://, unix://, "
                             "redis+cluster:// or rediss+cluster://")  # fmt: skip
        object.__setattr__(self, "redis_cluster_nodes", tuple(self.redis_cluster_nodes))
        for node in self.redis_cluster_nodes:
            cluster_node(node)
        cluster = urlsplit(self.redis_url or "").scheme in ("redis+cluster", "rediss+cluster")
        if self.redis_cluster_nodes and not cluster:
            raise ValueError(f"redis_cluster_nodes={list(self.redis_cluster_nodes)!r} need a redis+cluster:// or "
                             f"rediss+cluster:// redis_url, not {self.redis_url!r}")  # fmt: skip

    @property
    def mac_key(self) -> bytes | None:
        """`tier_hmac_key` as bytes (None: pages are checksummed, not signed)."""
        key = self.tier_hmac_key
        return key if isinstance(key, bytes) else None

    @property
    def disk_max_bytes(self) -> int:
        """`disk_offload_max_gb` in bytes."""
        return int(self.disk_offload_max_gb * 1024**3)
