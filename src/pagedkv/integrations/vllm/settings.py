"""`ConnectorSettings`: the ``kv_connector_extra_config`` of `PagedKVConnector`, checked.

Pure Python (no vLLM, no torch): vLLM hands the connector the JSON object of
``--kv-transfer-config '{"kv_connector_extra_config": {...}}'``, so every value
may be of any JSON type. `parse_extra_config` accepts exactly the keys of
`EXTRA_CONFIG_KEYS` and raises `ValueError` / `TypeError` naming the key, the
value and the limit for anything else, before a tier is built.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pagedkv.connector_config import KVConnectorConfig

__all__ = ["EXTRA_CONFIG_KEYS", "ConnectorSettings", "parse_extra_config"]

# key -> what it sets (the docs table of docs/VLLM.md lists the same keys)
EXTRA_CONFIG_KEYS: dict[str, str] = {
    "redis_url": "redis://host:port/db, rediss:// (TLS), unix:///path, or redis+cluster://host:port",
    "redis_cluster_nodes": 'a Redis Cluster by its startup nodes, ["host:port", ...] (instead of redis_url)',
    "redis_key_prefix": "prefix of every Redis key (namespaces a shared server)",
    "redis_username": "Redis ACL user (overrides the URL's)",
    "redis_password": "Redis password (overrides the URL's)",
    "redis_ttl_s": "expiry of stored pages in seconds (default: none, the server's maxmemory policy evicts)",
    "redis_timeout_s": "connect and socket timeout of each Redis call",
    "redis_retry_s": "after a Redis error, Redis is skipped for this long",
    "disk_offload_dir": "directory of the disk tier (one checked file per page)",
    "disk_offload_max_gb": "size cap of the disk tier (least recently used pages are deleted)",
    "tier_hmac_key": "secret (>= 16 bytes) that signs every stored page and is required on every load",
    "tier_hmac_key_file": "file holding that secret (instead of tier_hmac_key)",
    "model_id": "names the model in the layout fingerprint (default: the served model's name)",
    "load_async": "true: load between steps (finished_recving); false: before the step's forward",
    "io_threads": "threads per tier doing disk / Redis transfers",
    "max_pending_save_mb": "bound on page bytes copied off the device but not yet written",
}

_MAX_THREADS = 256
_MAX_NODES = 64


def _fail_type(key: str, value: object, what: str) -> TypeError:
    return TypeError(f"kv_connector_extra_config[{key!r}]={value!r} must be {what}")


def _str(extra: Mapping[str, Any], key: str, *, nonempty: bool = True) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _fail_type(key, value, "a str")
    if nonempty and not value:
        raise ValueError(f"kv_connector_extra_config[{key!r}]='' must not be empty")
    return value


def _number(extra: Mapping[str, Any], key: str, default: float | None, lo: float, hi: float) -> float | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail_type(key, value, "a number")
    if not (lo < value <= hi) or not math.isfinite(value):
        raise ValueError(f"kv_connector_extra_config[{key!r}]={value!r} must be > {lo:g} and <= {hi:g}")
    return float(value)


def _int(extra: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail_type(key, value, "an int")
    if not lo <= value <= hi:
        raise ValueError(f"kv_connector_extra_config[{key!r}]={value} must be in [{lo}, {hi}]")
    return value


def _nodes(extra: Mapping[str, Any]) -> tuple[str, ...]:
    """``redis_cluster_nodes``: a non-empty list of "host:port" (port in [1, 65535])."""
    value = extra.get("redis_cluster_nodes")
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not value:
        raise _fail_type("redis_cluster_nodes", value, 'a non-empty list of "host:port" strings')
    if len(value) > _MAX_NODES:
        raise ValueError(f"kv_connector_extra_config['redis_cluster_nodes'] has {len(value)} nodes; at most "
                         f"{_MAX_NODES}")  # fmt: skip
    for node in value:
        if not isinstance(node, str):
            raise _fail_type("redis_cluster_nodes", node, 'a "host:port" string (one node)')
        host, sep, port = node.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or "/" in host or "@" in host:
            raise ValueError(f"kv_connector_extra_config['redis_cluster_nodes'] node {node!r} must be host:port "
                             "with a port in [1, 65535]")  # fmt: skip
    return tuple(value)


def _hmac_key(extra: Mapping[str, Any]) -> bytes | None:
    key, path = extra.get("tier_hmac_key"), _str(extra, "tier_hmac_key_file")
    if key is not None and path is not None:
        raise ValueError("kv_connector_extra_config sets both 'tier_hmac_key' and 'tier_hmac_key_file'; give one")
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = f.read(4097)
        except OSError as exc:
            raise ValueError(f"kv_connector_extra_config['tier_hmac_key_file']={path!r} cannot be read: "
                             f"{exc.strerror or exc}") from exc  # fmt: skip
        if len(data) > 4096:
            raise ValueError(f"kv_connector_extra_config['tier_hmac_key_file']={path!r} holds more than 4096 bytes; "
                             "a key file holds only the key")  # fmt: skip
        key = data.rstrip(b"\r\n")  # an editor's final newline is not part of the key
        name = "tier_hmac_key_file"
    else:
        name = "tier_hmac_key"
    if key is None:
        return None
    if not isinstance(key, str | bytes):
        raise _fail_type(name, "<redacted>", f"a str (got {type(key).__name__})")
    raw = key.encode("utf-8") if isinstance(key, str) else key
    if len(raw) < 16:
        raise ValueError(f"kv_connector_extra_config[{name!r}] has {len(raw)} bytes; it needs at least 16")
    return raw


@dataclass(frozen=True)
class ConnectorSettings:
    """The checked extra config. `tiers` is what `pagedkv.offload` builds the tiers from.

    Attributes:
        tiers: disk directory and / or Redis server, key prefix, HMAC key, timeouts, threads.
        model_id: the model's name in every page's layout fingerprint ("" until the connector
            fills in the served model's name).
        load_async: loads run between engine steps (vLLM's ``WAITING_FOR_REMOTE_KVS``) instead
            of before the forward of the step that needs them.
        max_pending_save_bytes: a save waits for the tiers' writes once this many page bytes are
            copied off the device and not yet written.
    """

    tiers: KVConnectorConfig
    model_id: str
    load_async: bool
    max_pending_save_bytes: int

    @property
    def has_disk(self) -> bool:
        return self.tiers.disk_offload_dir is not None

    @property
    def has_redis(self) -> bool:
        return self.tiers.redis_url is not None


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Check `extra` (vLLM's ``kv_connector_extra_config``) and return its settings.

    At least one tier (``disk_offload_dir``, ``redis_url`` or ``redis_cluster_nodes``) is required.
    Raises TypeError / ValueError naming the key, the value (never a secret's) and the limit; reads
    ``tier_hmac_key_file`` when given; changes nothing else (no directory is created, no server is
    contacted)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"kv_connector_extra_config={extra!r} must be a dict")
    unknown = sorted(str(k) for k in extra if k not in EXTRA_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown key(s) {unknown}; PagedKVConnector takes "
                         f"{sorted(EXTRA_CONFIG_KEYS)}")  # fmt: skip
    url, nodes = _str(extra, "redis_url"), _nodes(extra)
    if url is not None and nodes:
        raise ValueError("kv_connector_extra_config sets both 'redis_url' and 'redis_cluster_nodes'; give one")
    if url is not None and urlsplit(url).scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise ValueError(f"kv_connector_extra_config['redis_url']={url!r} must start with redis://, rediss://, "
                         "unix://, redis+cluster:// or rediss+cluster://")  # fmt: skip
    if nodes:
        url = f"redis+cluster://{nodes[0]}"
    disk = _str(extra, "disk_offload_dir")
    if disk is not None and "\x00" in disk:
        raise ValueError("kv_connector_extra_config['disk_offload_dir'] contains a NUL byte")
    if url is None and disk is None:
        raise ValueError("kv_connector_extra_config needs a tier: 'disk_offload_dir' (a directory), 'redis_url' or "
                         "'redis_cluster_nodes'")  # fmt: skip
    load_async = extra.get("load_async", False)
    if not isinstance(load_async, bool):
        raise _fail_type("load_async", load_async, "true or false")
    prefix = _str(extra, "redis_key_prefix", nonempty=False)
    model_id = _str(extra, "model_id") or ""
    for key, text in (("redis_key_prefix", prefix), ("model_id", model_id)):
        if text is not None and (len(text) > 256 or any(c in text for c in "\x00\r\n ")):
            raise ValueError(f"kv_connector_extra_config[{key!r}]={text[:40]!r}... must be at most 256 characters, "
                             "without spaces, NUL or line breaks")  # fmt: skip
    ttl = _int(extra, "redis_ttl_s", None, 1, 2**31 - 1)
    pending_mb = _int(extra, "max_pending_save_mb", 2048, 1, 2**20)
    assert pending_mb is not None
    options: dict[str, Any] = dict(
        model_id=model_id,
        disk_offload_dir=os.path.abspath(disk) if disk is not None else None,
        disk_offload_max_gb=_number(extra, "disk_offload_max_gb", 50.0, 0.0, 2.0**20),
        redis_url=url,
        redis_key_prefix="pagedkv:" if prefix is None else prefix,
        redis_username=_str(extra, "redis_username"),
        redis_password=_str(extra, "redis_password"),
        redis_ttl_s=ttl,
        redis_timeout_s=_number(extra, "redis_timeout_s", 1.0, 0.0, 3600.0),
        redis_retry_s=_number(extra, "redis_retry_s", 5.0, 0.0, 86400.0),
        io_threads=_int(extra, "io_threads", 4, 1, _MAX_THREADS),
        tier_hmac_key=_hmac_key(extra),
        redis_cluster_nodes=nodes,
    )
    return ConnectorSettings(KVConnectorConfig(**options), model_id, load_async, pending_mb * 2**20)
