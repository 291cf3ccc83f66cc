"""`PagedKVStorage`: an SGLang HiCache L3 storage backend (`HiCacheStorage`) over pagedkv's disk / Redis tiers.

SGLang's dynamic loader builds it as ``PagedKVStorage(storage_config, kwargs)`` and the cache
controller then calls ``register_mem_pool_host(host_pool)``; from then on its prefetch and backup
threads call the batch methods with 64-hex SHA-256 page keys. This module imports sglang (it is
loaded from `pagedkv.integrations.sglang` only when SGLang asks for the class).

- **Pages**: one `pagedkv.offload.format` page per SGLang page key: the checked header, then the
  pool's flat data page (K, then V). `HostPages` gives the tiers the page's parts in place, so the
  v1 calls copy nothing on our side between the host pool and the medium's I/O; the legacy calls
  move the flat page tensors SGLang passes. Legacy and v1 store the same bytes.
- **Namespace**: ``<model>_<tp_rank>_<tp_size>`` (and ``_<pp_size>_<pp_rank>`` under pipeline
  parallelism), as SGLang's HiCacheFile suffixes its files, then the layout fingerprint (model,
  parallel ranks, pool class and layout, dtype, layers, heads, head dims, page size, part sizes)
  and, for signed pages, ``-`` and the HMAC key's public id (`pagedkv.offload.format.tier_namespace`):
  Redis keys ``<redis_key_prefix><namespace>:<fingerprint>[-<key id>]:<sha256 hex>``, files
  ``<disk_offload_dir>/<namespace>/<fingerprint>[-<key id>]/<byte>/<sha256 hex>.page``. ``model_id``
  (extra config) replaces SGLang's model name in both. A page of another layout or key is
  never found, so it is a miss.
- **Checks**: `batch_exists` reads each page's header (`check_header`: key, layout, length, signed
  or not) and stops at the first page that is missing or fails; the reads check the payload's
  checksum or HMAC too. A page that fails either is refused: counted, logged once, reported missing
  (a read stops at it, as `batch_exists` does), and left in place (a reader never deletes a page;
  this backend writes over it when SGLang stores that page again).
- **Failures**: nothing raises into SGLang's threads. A Redis outage makes reads and lookups
  misses and writes return False (`skipped_writes`), and the tier is skipped for `redis_retry_s`
  before it is tried again; a bug-level error in a call is logged once and answered as a miss.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,unused-ignore]
    HiCacheStorage,
    PoolName,
    PoolTransferResult,
)

from pagedkv.integrations.sglang.host_pages import HostPages
from pagedkv.integrations.sglang.keys import namespace, page_key
from pagedkv.integrations.sglang.settings import StorageSettings
from pagedkv.offload.format import layout_fingerprint, tier_namespace
from pagedkv.offload.tier import LowerTier

__all__ = ["FORMAT_TAG", "PagedKVStorage"]

FORMAT_TAG = "pagedkv-sglang-hicache-1"  # part of every fingerprint: bump when what a page holds changes
HASH_ALGO = "sha256"  # SGLang's page keys are SHA-256 digests
_T = TypeVar("_T")
log = logging.getLogger("pagedkv.integrations.sglang")


def _ignore(i: int) -> None:
    """The tiers' `done` callback: the rows are the host pool's, which outlives every write we wait for."""


class PagedKVStorage(HiCacheStorage):  # type: ignore[misc]
    """HiCache L3 storage over one pagedkv tier (`RedisTier` or `DiskTier`) for an MHA host pool.

    Built by SGLang as ``cls(storage_config, kwargs)``: checks ``storage_config.extra_config``
    (`StorageSettings`; a bad key raises `TypeError` / `ValueError` naming it), opens no connection.
    `register_mem_pool_host` builds the tier for the pool's layout; every other call before it
    answers a miss. Thread-safe: SGLang's prefetch and backup threads call it at once (the disk
    tier's calls are serialized by a lock; the Redis tier is thread-safe itself)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = StorageSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.namespace = namespace(storage_config, self.settings.model_id)
        self.model_id = self.settings.model_id or storage_config.model_name or ""
        self.config = self.settings.connector_config(self.model_id, self.namespace)
        if self.settings.medium == "redis":
            from pagedkv.offload.redis_client import client_factory

            client_factory(self.config)  # checks the URL and TLS files now (redis-py needed); connects nothing
        self.tier: LowerTier | None = None
        self.pages: HostPages | None = None
        self.fingerprint = b""
        self._disk_lock = threading.Lock() if self.settings.medium == "disk" else None
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}  # fmt: skip
        self._logged: set[str] = set()

    # ----------------------------------------------------------------- setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Build the tier for `mem_pool_host` (an `MHATokenToKVPoolHost` in a layout `HostPages`
        serves, else `TypeError` / `ValueError`). A second call replaces the tier (the old one is
        shut down after its writes finish)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        c = self.storage_config
        describe: list[object] = [FORMAT_TAG, ("ranks", c.tp_rank, c.tp_size, c.pp_rank, c.pp_size, c.attn_cp_rank,
                                               c.attn_cp_size, getattr(c, "dcp_rank", 0), getattr(c, "dcp_size", 1)),
                                  *pages.describe()]  # fmt: skip
        fingerprint = layout_fingerprint(describe, self.model_id)
        if self.settings.medium == "redis":
            from pagedkv.offload.redis_tier import RedisTier

            tier: LowerTier = RedisTier(self.config, pages.row_bytes, fingerprint, HASH_ALGO)
        else:
            from pagedkv.offload.disk import DiskTier

            assert self.config.disk_offload_dir is not None
            tier = DiskTier(self.config.disk_offload_dir, pages.row_bytes, self.config.disk_max_bytes, fingerprint,
                            HASH_ALGO, threads=self.config.io_threads, mac_key=self.config.mac_key,
                            timeout_s=self.config.disk_timeout_s)  # fmt: skip
        old, self.tier, self.pages, self.fingerprint = self.tier, tier, pages, fingerprint
        if old is not None:
            old.shutdown()
        log.info("pagedkv HiCache storage: %s tier, %d-byte pages, namespace %s, pages under %s",
                 tier.name, pages.row_bytes, self.namespace, tier_namespace(fingerprint, self.config.mac_key))  # fmt: skip

    # ----------------------------------------------------------------- plumbing
    def _guard(self, what: str, default: _T, call: Callable[[], _T]) -> _T:
        """`call()`, or `default` (a miss) after logging an unexpected error once per kind."""
        try:
            return call()
        except Exception as exc:  # never into SGLang's prefetch / backup threads
            level = logging.DEBUG if what in self._logged else logging.WARNING
            self._logged.add(what)
            log.log(level, "pagedkv HiCache storage: %s failed (%s: %s); answered as a miss", what,
                    type(exc).__name__, exc, exc_info=level == logging.WARNING)  # fmt: skip
            return default

    @contextlib.contextmanager
    def _serial(self) -> Iterator[LowerTier]:
        tier = self.tier
        if tier is None:
            raise RuntimeError("no host pool registered yet (register_mem_pool_host)")
        if self._disk_lock is None:
            yield tier
            return
        with self._disk_lock:
            yield tier

    def _fetch(self, keys: Sequence[str], rows: Sequence[Any]) -> int:
        start = time.perf_counter()
        with self._serial() as tier:
            got = tier.fetch([page_key(k) for k in keys], rows)
        self._observe("prefetch", got, time.perf_counter() - start)
        tier.stats.add(lookups=len(keys), pages_loaded=got, bytes_loaded=got * tier_row_bytes(self))
        return got

    def _store(self, keys: Sequence[str], rows: Sequence[Any]) -> list[bool]:
        """Write `rows` and wait; per key, whether the page is stored now (written, or already there)."""
        start = time.perf_counter()
        ids = [page_key(k) for k in keys]
        with self._serial() as tier:
            before = (tier.stats.skipped_writes, tier.stats.errors)
            tier.store(ids, rows, _ignore)
            tier.wait()
            if (tier.stats.skipped_writes, tier.stats.errors) == before:
                stored = [True] * len(ids)
            else:  # a write failed (here or in another thread): ask the medium what it holds
                stored = tier.contains(ids)
        self._observe("backup", sum(stored), time.perf_counter() - start)
        return stored

    def _observe(self, kind: str, pages: int, seconds: float) -> None:
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        gb = pages * tier_row_bytes(self) / 1e9
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / max(seconds, 1e-9))

    def _flat_rows(self, tensors: Sequence[Any]) -> list[memoryview] | None:
        """Byte views of flat page tensors (SGLang's legacy calls), or None if one is not a page."""
        rows = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.device.type != "cpu":
                return None
            view = memoryview(t.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
            if view.nbytes != tier_row_bytes(self):
                return None
            rows.append(view)
        return rows

    # ----------------------------------------------------------------- zero-copy (interface_v1)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read the pages of `keys` into the host slots `host_indices` (`page_size` per key) in place;
        True for the leading pages read and checked, False from the first missing or refused one."""

        def run() -> list[bool]:
            assert self.pages is not None
            got = self._fetch(keys, self.pages.rows(host_indices, len(keys)))
            return [i < got for i in range(len(keys))]

        return self._guard("batch_get_v1", [False] * len(keys), run)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Write the host pages at `host_indices` under `keys` (from the pool, no copy on our side) and wait;
        per key, whether it is stored."""

        def run() -> list[bool]:
            assert self.pages is not None
            return self._store(keys, self.pages.rows(host_indices, len(keys)))

        return self._guard("batch_set_v1", [False] * len(keys), run)

    # ----------------------------------------------------------------- legacy flat pages
    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Read each page into its flat page tensor of `target_locations` (new ones when None); the
        tensor for each leading page read and checked, None from the first missing or refused one."""

        def run() -> list[Any]:
            assert self.pages is not None
            pool = self.pages.pool
            targets = list(target_locations) if target_locations is not None else [
                torch.empty(tier_row_bytes(self) // pool.dtype.itemsize, dtype=pool.dtype) for _ in keys]  # fmt: skip
            rows = self._flat_rows(targets)
            if rows is None or len(rows) != len(keys):
                raise ValueError("target_locations must be one contiguous host flat page per key")
            got = self._fetch(keys, rows)
            return [t if i < got else None for i, t in enumerate(targets)]

        return self._guard("batch_get", [None] * len(keys), run)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        """Write each flat page tensor of `values` under its key and wait; True if every page is stored."""

        def run() -> bool:
            rows = self._flat_rows(list(values or []))
            if rows is None or len(rows) != len(keys):
                raise ValueError("values must be one contiguous host flat page per key")
            return all(self._store(keys, rows))

        return self._guard("batch_set", False, run)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """`batch_get` of one key: the tensor, or None."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """`batch_set` of one key."""
        return value is not None and self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        """`batch_exists` of one key."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` are stored with a header a read accepts (the headers are read,
        not the payloads; a refused page stays in place). 0 on an outage or before a pool is registered."""

        def run() -> int:
            with self._serial() as tier:
                found = tier.probe([page_key(k) for k in keys])
            return found.index(False) if False in found else len(found)

        return self._guard("batch_exists", 0, run)

    # ----------------------------------------------------------------- v2 (pool transfers)
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """`batch_exists` as a `PoolTransferResult`. Only the KV pool is stored: with a transfer of any
        other pool (Mamba, SWA, indexer, ... sidecars) nothing is restorable, so the hit is 0."""
        others = [t.name for t in pool_transfers or [] if t.name != PoolName.KV]
        if others:
            self._once("sidecar", f"sidecar pools {others} are not stored by pagedkv; their prefixes miss")
            return PoolTransferResult(0, {}, [])
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Per transfer: the KV pool's `batch_get_v1`; any other pool all False (not stored)."""
        return self._v2(transfers, self.batch_get_v1)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Per transfer: the KV pool's `batch_set_v1`; any other pool all False (not stored)."""
        return self._v2(transfers, self.batch_set_v1)

    def _v2(self, transfers: list[Any], op: Callable[[list[str], torch.Tensor], list[bool]]) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if transfer.name == PoolName.KV and transfer.host_indices is not None:
                out[transfer.name] = op(keys, transfer.host_indices)
            else:
                self._once("sidecar", f"pool {transfer.name} is not stored by pagedkv; its pages miss")
                out[transfer.name] = [False] * len(keys)
        return out

    def _once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("pagedkv HiCache storage: %s", message)

    # ----------------------------------------------------------------- maintenance
    def clear(self) -> None:
        """Delete every page of this namespace and layout on the medium (for Redis: every process's)."""

        def run() -> None:
            with self._serial() as tier:
                tier.reset()

        self._guard("clear", None, run)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the calls since the last `get_stats` (pages and GB/s per batch
        read and write; filled when SGLang enables storage metrics), or None when sglang has none."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            return None
        with self._metrics_lock:
            metrics = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for values in self._metrics.values():
                values.clear()
        return metrics

    def tier_stats(self) -> dict[str, object]:
        """The tier's counters (`TierStats.snapshot`: pages and bytes each way, lookups, errors, refused
        pages, skipped writes, latencies); empty before a pool is registered."""
        return self.tier.stats.snapshot() if self.tier is not None else {}

    def close(self) -> None:
        """Finish pending writes and release the tier's threads and connections."""
        if self.tier is not None:
            self.tier.shutdown()


def tier_row_bytes(storage: PagedKVStorage) -> int:
    """Bytes of one stored page's payload (0 before a pool is registered)."""
    return storage.pages.row_bytes if storage.pages is not None else 0
