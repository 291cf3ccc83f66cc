"""The tier keys that every pagedkv engine integration accepts in its extra config, checked one way.

Pure Python (no torch, no engine, no redis). vLLM's ``kv_connector_extra_config`` (`PagedKVConnector`)
and SGLang's ``--hicache-storage-backend-extra-config`` (`PagedKVStorage`) both hand pagedkv a JSON
object; the keys that configure pagedkv's tiers have the names of `KVConnectorConfig`'s fields and the
same meaning, limits and error messages in both (each message names the object, the key, the value
and the limit, never a secret):

    key                   type, default          meaning
    redis_url             str                    redis://, rediss://, unix://, redis+cluster://, rediss+cluster://
    redis_cluster_nodes   ["host:port", ...]     a cluster's startup nodes: alone, the first one makes a
                                                 redis+cluster:// URL; with a cluster URL, tried after it
    redis_key_prefix      str, per integration   prefix of every Redis key (at most 256 characters, no
                                                 whitespace, NUL or glob characters * ? [ ] \\)
    redis_username        str                    ACL user (overrides the URL's)
    redis_password        str                    password (overrides the URL's)
    redis_ttl_s           int in [1, 2**31-1]    expiry of stored pages (none: the server's policy evicts)
    redis_timeout_s       number in (0, 3600]    connect and socket timeout of each Redis call (1.0)
    redis_retry_s         number in (0, 86400]   after a Redis error, Redis is skipped this long (5.0)
    disk_offload_dir      str                    directory of the disk tier (made absolute)
    disk_offload_max_gb   number in (0, 2**20]   size cap of the disk tier (50)
    disk_timeout_s        number in (0, 3600]    a disk read with no progress this long is a miss (5.0)
    tier_hmac_key         str of >= 16 bytes     signs every page, required on every load
    tier_hmac_key_file    path                   that key in a file (<= 4096 bytes, a final newline dropped)
    model_id              str                    the model's name in every page's layout fingerprint
                                                 (default: the served model's name; no whitespace, NUL)
    io_threads            int in [1, 64], 4      threads per tier doing disk / Redis transfers
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pagedkv.params.connector import cluster_node

__all__ = ["MAX_IO_THREADS", "TIER_KEYS", "ExtraConfig"]

MAX_IO_THREADS = 64
MAX_NODES = 64
MIN_HMAC_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
TIER_KEYS = frozenset({
    "redis_url", "redis_cluster_nodes", "redis_key_prefix", "redis_username", "redis_password", "redis_ttl_s",
    "redis_timeout_s", "redis_retry_s", "disk_offload_dir", "disk_offload_max_gb", "disk_timeout_s", "tier_hmac_key",
    "tier_hmac_key_file", "model_id", "io_threads",
})  # fmt: skip
REDIS_ONLY = ("redis_key_prefix", "redis_username", "redis_password", "redis_ttl_s", "redis_timeout_s", "redis_retry_s")


class ExtraConfig:
    """Checked reads of one integration's extra-config object `extra`, called `label` in every message
    (``"kv_connector_extra_config"``, ``"extra_config"``). Reading a key raises `TypeError` (wrong
    type) or `ValueError` (wrong value) naming the key, the value and the limit; nothing else."""

    def __init__(self, label: str, extra: Mapping[str, Any]) -> None:
        self.label = label
        self.extra = extra

    def where(self, key: str, value: object) -> str:
        """``label['key']=value`` for a message."""
        return f"{self.label}[{key!r}]={value!r}"

    def type_error(self, key: str, value: object, what: str) -> TypeError:
        return TypeError(f"{self.where(key, value)} must be {what}")

    def text(self, key: str, *, nonempty: bool = True) -> str | None:
        """A str (None when absent); empty only with ``nonempty=False``."""
        value = self.extra.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.type_error(key, value, "a str")
        if nonempty and not value:
            raise ValueError(f"{self.where(key, value)} must not be empty")
        return value

    def number(self, key: str, default: float, lo: float, hi: float) -> float:
        """A finite number in ``(lo, hi]``."""
        value = self.extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.type_error(key, value, "a number")
        if not math.isfinite(value) or not lo < value <= hi:
            raise ValueError(f"{self.where(key, value)} must be > {lo:g} and <= {hi:g}")
        return float(value)

    def integer(self, key: str, default: int | None, lo: int, hi: int) -> int | None:
        """An int in ``[lo, hi]`` (bools refused; None when absent and `default` is None)."""
        value = self.extra.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.type_error(key, value, "an int")
        if not lo <= value <= hi:
            raise ValueError(f"{self.where(key, value)} must be in [{lo}, {hi}]")
        return value

    def name(self, key: str, default: str, *, glob: bool = True) -> str:
        """A key prefix or model id: at most 256 characters, no whitespace or NUL (nor, with ``glob=False``,
        the glob characters ``* ? [ ] \\``)."""
        value = self.text(key, nonempty=False)
        if value is None:
            return default
        banned = "\x00" if glob else "\x00*?[]\\"
        if len(value) > 256 or any(c.isspace() or c in banned for c in value):
            extra = "" if glob else " or * ? [ ] \\"
            raise ValueError(f"{self.label}[{key!r}]={value[:40]!r}... must be at most 256 characters, without "
                             f"whitespace, NUL{extra}")  # fmt: skip
        return value

    def redis(self) -> tuple[str | None, tuple[str, ...]]:
        """(``redis_url``, ``redis_cluster_nodes``): the URL's scheme checked; nodes alone make a
        ``redis+cluster://`` URL of the first (the rest stay startup nodes), nodes beside a URL need a
        cluster one."""
        url, nodes = self.text("redis_url"), self._nodes()
        if url is not None and urlsplit(url).scheme not in SCHEMES:
            raise ValueError(f"{self.where('redis_url', url)} must start with redis://, rediss://, unix://, "
                             "redis+cluster:// or rediss+cluster://")  # fmt: skip
        if nodes and url is None:
            return f"redis+cluster://{nodes[0]}", nodes[1:]
        if nodes and not urlsplit(url or "").scheme.endswith("+cluster"):
            raise ValueError(f"{self.label}['redis_cluster_nodes'] needs a redis+cluster:// or rediss+cluster:// "
                             f"redis_url (or none), not {url!r}")  # fmt: skip
        return url, nodes

    def _nodes(self) -> tuple[str, ...]:
        value = self.extra.get("redis_cluster_nodes")
        if value is None:
            return ()
        if not isinstance(value, list | tuple) or not value:
            raise self.type_error("redis_cluster_nodes", value, 'a non-empty list of "host:port" strs')
        if len(value) > MAX_NODES:
            raise ValueError(f"{self.label}['redis_cluster_nodes'] has {len(value)} nodes; at most {MAX_NODES}")
        for node in value:
            try:
                cluster_node(node)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{self.label}['redis_cluster_nodes']: {exc}") from exc
        return tuple(value)

    def disk_dir(self) -> str | None:
        """``disk_offload_dir`` as an absolute path (None when absent)."""
        path = self.text("disk_offload_dir")
        if path is not None and "\x00" in path:
            raise ValueError(f"{self.where('disk_offload_dir', path)} must be a path without NUL bytes")
        return None if path is None else os.path.abspath(path)

    def hmac_key(self) -> bytes | None:
        """``tier_hmac_key`` (UTF-8) or the contents of ``tier_hmac_key_file`` (a final line break dropped);
        at least 16 bytes. Reads the file."""
        key, path = self.extra.get("tier_hmac_key"), self.text("tier_hmac_key_file")
        if key is not None and path is not None:
            raise ValueError(f"{self.label} sets both 'tier_hmac_key' and 'tier_hmac_key_file'; give one")
        name = "tier_hmac_key"
        if path is not None:
            name = "tier_hmac_key_file"
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_KEY_FILE_BYTES + 1)
            except OSError as exc:
                raise ValueError(f"{self.where(name, path)} cannot be read: {exc.strerror or exc}") from exc
            if len(data) > MAX_KEY_FILE_BYTES:
                raise ValueError(f"{self.where(name, path)} holds more than {MAX_KEY_FILE_BYTES} bytes; a key file "
                                 "holds only the key")  # fmt: skip
            key = data.rstrip(b"\r\n")  # an editor's final newline is not part of the key
        if key is None:
            return None
        if not isinstance(key, str | bytes):
            raise self.type_error(name, "<redacted>", f"a str (got {type(key).__name__})")
        raw = key.encode("utf-8") if isinstance(key, str) else key
        if len(raw) < MIN_HMAC_KEY_BYTES:
            raise ValueError(f"{self.label}[{name!r}] has {len(raw)} bytes; it needs at least {MIN_HMAC_KEY_BYTES}")
        return raw

    def tier_options(self, default_prefix: str) -> dict[str, Any]:
        """Every tier key as `KVConnectorConfig` keyword arguments (``model_id`` as given, "" when absent;
        ``redis_key_prefix`` defaults to `default_prefix`)."""
        url, nodes = self.redis()
        return dict(
            model_id=self.name("model_id", ""), redis_url=url, redis_cluster_nodes=nodes,
            redis_key_prefix=self.name("redis_key_prefix", default_prefix, glob=False),
            redis_username=self.text("redis_username"), redis_password=self.text("redis_password"),
            redis_ttl_s=self.integer("redis_ttl_s", None, 1, 2**31 - 1),
            redis_timeout_s=self.number("redis_timeout_s", 1.0, 0.0, 3600.0),
            redis_retry_s=self.number("redis_retry_s", 5.0, 0.0, 86400.0),
            disk_offload_dir=self.disk_dir(), disk_offload_max_gb=self.number("disk_offload_max_gb", 50.0, 0.0, 2.0**20),
            disk_timeout_s=self.number("disk_timeout_s", 5.0, 0.0, 3600.0),
            tier_hmac_key=self.hmac_key(), io_threads=self.integer("io_threads", 4, 1, MAX_IO_THREADS),
        )  # fmt: skip
