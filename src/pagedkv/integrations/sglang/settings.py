"""`StorageSettings`: the ``--hicache-storage-backend-extra-config`` keys of `PagedKVStorage`, checked.

Pure Python (no torch, no sglang, no redis): SGLang hands the backend its JSON object as a dict,
`StorageSettings.from_extra_config` checks every key (a wrong type is a `TypeError`, a wrong value a
`ValueError`, each naming the key, the value and the limit) and refuses keys it does not know, so a
typo fails at startup instead of silently running without a tier.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagedkv.connector_config import KVConnectorConfig, cluster_node

__all__ = ["DEFAULT_KEY_PREFIX", "KNOWN_KEYS", "SGLANG_KEYS", "StorageSettings"]

DEFAULT_KEY_PREFIX = "pagedkv:sglang:"
MAX_IO_THREADS = 64
MIN_HMAC_KEY_BYTES = 16
# Keys SGLang itself reads from the same object (the dynamic loader's, the controller's, HiCache's knobs).
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
})  # fmt: skip
KNOWN_KEYS = frozenset({
    "redis_url", "redis_cluster_nodes", "redis_username", "redis_password", "redis_timeout_s", "redis_retry_s",
    "redis_ttl_s", "disk_dir", "capacity_gb", "hmac_key", "hmac_key_file", "key_prefix", "io_threads",
})  # fmt: skip
_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _where(key: str, value: object) -> str:
    return f"extra_config[{key!r}]={value!r}"


def _str(extra: Mapping[str, Any], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{_where(key, value)} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{_where(key, value)} must not be empty")
    return value


def _number(extra: Mapping[str, Any], key: str, default: float | None, low: float, high: float = math.inf) -> Any:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{_where(key, value)} must be a number, not {type(value).__name__}")
    if not (low < value < high) or math.isnan(value):
        raise ValueError(f"{_where(key, value)} must be > {low} and < {high}")
    return value


def _int(extra: Mapping[str, Any], key: str, default: int | None, low: int, high: int) -> int | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_where(key, value)} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{_where(key, value)} must be in {low}..{high}")
    return value


def _hmac_key(extra: Mapping[str, Any]) -> bytes | None:
    inline, path = _str(extra, "hmac_key"), _str(extra, "hmac_key_file")
    if inline is not None and path is not None:
        raise ValueError("extra_config has both 'hmac_key' and 'hmac_key_file'; give one")
    if path is not None:
        try:
            with open(path, "rb") as f:
                key = f.read(1 << 16).strip()
        except OSError as exc:
            raise ValueError(f"{_where('hmac_key_file', path)} cannot be read: {exc}") from exc
        if len(key) < MIN_HMAC_KEY_BYTES:
            raise ValueError(f"{_where('hmac_key_file', path)} holds a key of {len(key)} bytes (surrounding "
                             f"whitespace stripped); it needs at least {MIN_HMAC_KEY_BYTES}")  # fmt: skip
        return key
    if inline is None:
        return None
    key = inline.encode("utf-8")
    if len(key) < MIN_HMAC_KEY_BYTES:
        raise ValueError(f"extra_config['hmac_key'] has {len(key)} bytes; it needs at least {MIN_HMAC_KEY_BYTES}")
    return key


def _cluster_nodes(extra: Mapping[str, Any]) -> tuple[str, ...]:
    nodes = extra.get("redis_cluster_nodes")
    if nodes is None:
        return ()
    if not isinstance(nodes, list | tuple) or not nodes:
        raise TypeError(f"{_where('redis_cluster_nodes', nodes)} must be a non-empty list of 'host:port' strs")
    for node in nodes:
        try:
            cluster_node(node)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{_where('redis_cluster_nodes', nodes)}: {exc}") from exc
    return tuple(nodes)


@dataclass(frozen=True)
class StorageSettings:
    """Where and how `PagedKVStorage` keeps pages: exactly one medium, a Redis (server or cluster) or a
    directory. See docs/SGLANG.md for every key; build it with `from_extra_config`."""

    redis_url: str | None = None
    redis_cluster_nodes: tuple[str, ...] = ()  # startup nodes after the URL's (the URL: the first node)
    redis_username: str | None = None
    redis_password: str | None = field(default=None, repr=False)
    redis_timeout_s: float = 1.0
    redis_retry_s: float = 5.0
    redis_ttl_s: int | None = None
    disk_dir: str | None = None
    capacity_gb: float = 50.0
    hmac_key: bytes | None = field(default=None, repr=False)
    key_prefix: str = DEFAULT_KEY_PREFIX
    io_threads: int = 4

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """Check SGLang's ``extra_config`` dict. Raises `TypeError` / `ValueError` naming the key, its value
        and the limit: an unknown key, a wrong type, a value out of range, no medium or two, a key of
        the other medium, an unreadable or short HMAC key file. Reads the key file; no network."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra_config={extra!r} must be a JSON object (dict), not {type(extra).__name__}")
        unknown = sorted(str(k) for k in extra if k not in KNOWN_KEYS | SGLANG_KEYS)
        if unknown:
            raise ValueError(f"extra_config has unknown key(s) {unknown}; pagedkv's keys are {sorted(KNOWN_KEYS)}")
        url, nodes, disk = _str(extra, "redis_url"), _cluster_nodes(extra), _str(extra, "disk_dir")
        if url is not None and urlsplit(url).scheme not in _SCHEMES:
            raise ValueError(f"{_where('redis_url', url)} must start with one of {[s + '://' for s in _SCHEMES]}")
        if nodes and url is None:
            url, nodes = f"redis+cluster://{nodes[0]}", nodes[1:]
        elif nodes and not urlsplit(url or "").scheme.endswith("+cluster"):
            raise ValueError(f"extra_config['redis_cluster_nodes'] needs a redis+cluster:// or rediss+cluster:// "
                             f"redis_url, not {url!r}")  # fmt: skip
        if (url is None) == (disk is None):
            raise ValueError("extra_config must name exactly one medium: 'redis_url' (or 'redis_cluster_nodes') "
                             f"or 'disk_dir'; got {'both' if url else 'neither'}")  # fmt: skip
        medium_only = {"capacity_gb": disk, "redis_username": url, "redis_password": url, "redis_timeout_s": url,
                       "redis_retry_s": url, "redis_ttl_s": url, "key_prefix": url}  # fmt: skip
        for key, medium in medium_only.items():
            if key in extra and medium is None:
                other = "a Redis (redis_url)" if key != "capacity_gb" else "a directory (disk_dir)"
                raise ValueError(f"{_where(key, extra[key])} applies to {other} only; this backend uses "
                                 f"{'disk_dir' if disk else 'redis_url'}")  # fmt: skip
        prefix = extra.get("key_prefix", DEFAULT_KEY_PREFIX)
        if not isinstance(prefix, str):
            raise TypeError(f"{_where('key_prefix', prefix)} must be a str, not {type(prefix).__name__}")
        if any(c in prefix for c in "*?[]\\") or len(prefix) > 200:
            raise ValueError(f"{_where('key_prefix', prefix)} must be at most 200 characters, without * ? [ ] \\")
        if disk is not None and "\0" in disk:
            raise ValueError(f"{_where('disk_dir', disk)} must be a path without NUL bytes")
        return cls(
            redis_url=url, redis_cluster_nodes=nodes, redis_username=_str(extra, "redis_username"),
            redis_password=_str(extra, "redis_password"),
            redis_timeout_s=_number(extra, "redis_timeout_s", 1.0, 0.0, 3600.0),
            redis_retry_s=_number(extra, "redis_retry_s", 5.0, 0.0, 86400.0),
            redis_ttl_s=_int(extra, "redis_ttl_s", None, 1, 2**31 - 1), disk_dir=disk,
            capacity_gb=_number(extra, "capacity_gb", 50.0, 0.0, 2.0**40), hmac_key=_hmac_key(extra),
            key_prefix=prefix, io_threads=_int(extra, "io_threads", 4, 1, MAX_IO_THREADS) or 4,
        )  # fmt: skip

    @property
    def medium(self) -> str:
        """``"redis"`` or ``"disk"``."""
        return "redis" if self.redis_url is not None else "disk"

    def connector_config(self, model_id: str, namespace: str) -> KVConnectorConfig:
        """The tier settings pagedkv's `DiskTier` / `RedisTier` take: Redis keys under
        ``<key_prefix><namespace>:``, the disk tier under ``<disk_dir>/<namespace>``."""
        return KVConnectorConfig(
            model_id=model_id, redis_url=self.redis_url, redis_cluster_nodes=self.redis_cluster_nodes,
            redis_username=self.redis_username, redis_password=self.redis_password,
            redis_key_prefix=f"{self.key_prefix}{namespace}:", redis_ttl_s=self.redis_ttl_s,
            redis_timeout_s=self.redis_timeout_s, redis_retry_s=self.redis_retry_s, io_threads=self.io_threads,
            tier_hmac_key=self.hmac_key,
            disk_offload_dir=None if self.disk_dir is None else os.path.join(self.disk_dir, namespace),
            disk_offload_max_gb=self.capacity_gb,
        )  # fmt: skip
