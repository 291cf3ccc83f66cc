"""`ConnectorSettings`: the ``kv_connector_extra_config`` of `PagedKVConnector`, checked.

Pure Python (no vLLM, no torch): vLLM hands the connector the JSON object of
``--kv-transfer-config '{"kv_connector_extra_config": {...}}'``, so every value
may be of any JSON type. `parse_extra_config` accepts exactly the keys of
`EXTRA_CONFIG_KEYS` and raises `ValueError` / `TypeError` naming the key, the
value and the limit for anything else, before a tier is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.integrations.tier_keys import MAX_IO_THREADS, ExtraConfig
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["EXTRA_CONFIG_KEYS", "ConnectorSettings", "parse_extra_config"]

# key -> what it sets (the docs table of docs/VLLM.md lists the same keys)
EXTRA_CONFIG_KEYS: dict[str, str] = {
    "redis_url": "redis://host:port/db, rediss:// (TLS), unix:///path, or redis+cluster://host:port",
    "redis_cluster_nodes": 'a Redis Cluster\'s startup nodes, ["host:port", ...]: alone, or after a cluster redis_url',
    "redis_key_prefix": "prefix of every Redis key (namespaces a shared server)",
    "redis_username": "Redis ACL user (overrides the URL's)",
    "redis_password": "Redis password (overrides the URL's)",
    "redis_ttl_s": "expiry of stored pages in seconds (default: none, the server's maxmemory policy evicts)",
    "redis_timeout_s": "connect and socket timeout of each Redis call",
    "redis_retry_s": "after a Redis error, Redis is skipped for this long",
    "disk_offload_dir": "directory of the disk tier (one checked file per page)",
    "disk_offload_max_gb": "size cap of the disk tier (least recently used pages are deleted)",
    "disk_timeout_s": "a disk read that makes no progress for this long is a miss",
    "tier_hmac_key": "secret (>= 16 bytes) that signs every stored page and is required on every load",
    "tier_hmac_key_file": "file holding that secret (instead of tier_hmac_key)",
    "model_id": "names the model in the layout fingerprint (default: the served model's name)",
    "load_async": "true: load between steps (finished_recving); false: before the step's forward",
    "io_threads": f"threads per tier doing disk / Redis transfers (1 to {MAX_IO_THREADS})",
    "max_pending_save_mb": "bound on page bytes copied off the device but not yet written",
}


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
    checked = ExtraConfig("kv_connector_extra_config", extra)
    options = checked.tier_options(default_prefix="pagedkv:")
    if options["redis_url"] is None and options["disk_offload_dir"] is None:
        raise ValueError("kv_connector_extra_config needs a tier: 'disk_offload_dir' (a directory), 'redis_url' or "
                         "'redis_cluster_nodes'")  # fmt: skip
    load_async = extra.get("load_async", False)
    if not isinstance(load_async, bool):
        raise checked.type_error("load_async", load_async, "true or false")
    pending_mb = checked.integer("max_pending_save_mb", 2048, 1, 2**20)
    assert pending_mb is not None
    tiers = KVConnectorConfig(**options)
    return ConnectorSettings(tiers, tiers.model_id, load_async, pending_mb * 2**20)
