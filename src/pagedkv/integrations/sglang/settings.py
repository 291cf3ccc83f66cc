"""`StorageSettings`: the ``--hicache-storage-backend-extra-config`` keys of `PagedKVStorage`, checked.

Pure Python (no torch, no sglang, no redis): SGLang hands the backend its JSON object as a dict,
`StorageSettings.from_extra_config` checks every key (a wrong type is a `TypeError`, a wrong value a
`ValueError`, each naming the key, the value and the limit) and refuses keys it does not know, so a
typo fails at startup instead of silently running without a tier. The tier keys are pagedkv's own
(`KVConnectorConfig`'s field names), checked by `pagedkv.integrations.tier_keys` exactly as the vLLM
connector checks them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedkv.integrations.tier_keys import MAX_IO_THREADS, REDIS_ONLY, TIER_KEYS, ExtraConfig
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["DEFAULT_KEY_PREFIX", "KNOWN_KEYS", "MAX_IO_THREADS", "SGLANG_KEYS", "StorageSettings"]

DEFAULT_KEY_PREFIX = "pagedkv:sglang:"
# Keys SGLang itself reads from the same object (the dynamic loader's, the controller's, HiCache's knobs).
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
})  # fmt: skip
KNOWN_KEYS = TIER_KEYS


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
    disk_offload_dir: str | None = None
    disk_offload_max_gb: float = 50.0
    disk_timeout_s: float = 5.0
    tier_hmac_key: bytes | None = field(default=None, repr=False)
    redis_key_prefix: str = DEFAULT_KEY_PREFIX
    io_threads: int = 4
    model_id: str = ""  # "" : SGLang's model name

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
        options = ExtraConfig("extra_config", extra).tier_options(default_prefix=DEFAULT_KEY_PREFIX)
        url, disk = options["redis_url"], options["disk_offload_dir"]
        if (url is None) == (disk is None):
            raise ValueError("extra_config must name exactly one medium: 'redis_url' (or 'redis_cluster_nodes') "
                             f"or 'disk_offload_dir'; got {'both' if url else 'neither'}")  # fmt: skip
        medium_only = {"disk_offload_max_gb": disk, "disk_timeout_s": disk, **{key: url for key in REDIS_ONLY}}
        for key, medium in medium_only.items():
            if key in extra and medium is None:
                other = "a directory (disk_offload_dir)" if key.startswith("disk_") else "a Redis (redis_url)"
                raise ValueError(f"extra_config[{key!r}]={extra[key]!r} applies to {other} only; this backend uses "
                                 f"{'disk_offload_dir' if disk else 'redis_url'}")  # fmt: skip
        return cls(**options)

    @property
    def medium(self) -> str:
        """``"redis"`` or ``"disk"``."""
        return "redis" if self.redis_url is not None else "disk"

    def connector_config(self, model_id: str, namespace: str) -> KVConnectorConfig:
        """The tier settings pagedkv's `DiskTier` / `RedisTier` take, for the model `model_id` (the
        settings' own `model_id` when set wins): Redis keys under ``<redis_key_prefix><namespace>:``, the
        disk tier under ``<disk_offload_dir>/<namespace>``."""
        return KVConnectorConfig(
            model_id=self.model_id or model_id, redis_url=self.redis_url, redis_cluster_nodes=self.redis_cluster_nodes,
            redis_username=self.redis_username, redis_password=self.redis_password,
            redis_key_prefix=f"{self.redis_key_prefix}{namespace}:", redis_ttl_s=self.redis_ttl_s,
            redis_timeout_s=self.redis_timeout_s, redis_retry_s=self.redis_retry_s, io_threads=self.io_threads,
            tier_hmac_key=self.tier_hmac_key,
            disk_offload_dir=None if self.disk_offload_dir is None else os.path.join(self.disk_offload_dir, namespace),
            disk_offload_max_gb=self.disk_offload_max_gb, disk_timeout_s=self.disk_timeout_s,
        )  # fmt: skip
