"""`RedisTier`: pages in a Redis (or Valkey) server that many engine processes share.

One string value per page, no pickle, under

    <redis_key_prefix><namespace>:<content hash, hex>  ->  112-byte header + page row

(`offload.format`). The namespace is the layout fingerprint (32 hex: model id,
dtype, page size, heads, layers, TP degree), then ``-`` and the HMAC key's
public id for signed pages (`format.tier_namespace`), so engines read only
pages of their own layout and key; the prefix namespaces a shared server. A
reader checks header and checksum before a byte reaches the KV cache; a value
it refuses is a miss for it, counted and logged once (once per version of the
value), and never deleted by it: what removes it is `redis_ttl_s`, the
server's eviction, `reset`, or this tier storing that page again after it
computed it (a value it refused is written over; others are ``SET NX``).
Writes run on `io_threads` threads: one pipelined EXISTS, then ``SET NX``
(``EX redis_ttl_s`` when set; a page offered again gets its expiry refreshed)
for the missing pages. Reads are pipelined MGETs of at most
`FETCH_CHUNK_BYTES`, stopping at the first miss.

Failure is not an outage. Every Redis call has `redis_timeout_s` and no
client-side retry; any Redis or socket error is counted (`stats.errors`,
`skipped_writes` for lost writes), logged once, reported as a miss, and the
tier is skipped without a network call for `redis_retry_s`, then tried
again; the first success after that logs the recovery once. Nothing raises
into the engine, which recomputes what it could not load.

Valkey works unchanged (same protocol). A ``redis+cluster://host:port`` URL
(``rediss+cluster://`` for TLS) uses a Redis Cluster (`redis.cluster.RedisCluster`,
see `offload.redis_client`): page keys carry no hash tag, so one batch spreads
over the slots of every primary; reads are ``mget_nonatomic`` (one MGET per
slot, pipelined per node), writes the same per-node pipelines, and `reset`
SCANs every primary. A node that is down fails the whole call like a dead
server: counted, a miss, retried after `redis_retry_s`. The cluster client
connects (discovers the nodes) on first use, so an unreachable cluster at
startup is an error counted like any other.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedkv.core.events import BlockRemoved, EventSink
from pagedkv.offload.format import (
    HEADER_SIZE,
    check_header,
    check_page,
    decode_header,
    encode_header,
    payload_parts,
    seal,
    tier_namespace,
)
from pagedkv.offload.redis_client import client_factory, import_redis, is_cluster, redis_client, unlink_prefix, where
from pagedkv.offload.tier import Done, LowerTier, OnceLogger, Row, check_framed, hand_back
from pagedkv.offload.tier_stats import TierStats
from pagedkv.params.connector import KVConnectorConfig

__all__ = ["FETCH_CHUNK_BYTES", "RedisTier", "redis_client"]

FETCH_CHUNK_BYTES = 32 * 2**20  # one MGET reads at most this much; a long prefix takes several round trips
SCAN_COUNT = 512
MAX_REFUSED = 4096  # refused values remembered (the same value is counted once, and written over)


class RedisTier(LowerTier):
    """Pages of one layout (`fingerprint`) in the Redis server of `config`, shared by every process
    using the same `redis_key_prefix`, fingerprint and `tier_hmac_key` (or none). Thread-safe; never
    raises for a Redis problem."""

    name = "redis"
    medium = "REDIS"

    def __init__(
        self, config: KVConnectorConfig, row_bytes: int, fingerprint: bytes, hash_algo: str,
        *, emit: EventSink | None = None,
    ) -> None:  # fmt: skip
        if row_bytes <= 0 or len(fingerprint) != 16:
            raise ValueError(f"row_bytes={row_bytes} must be > 0 and the fingerprint 16 bytes")
        redis = import_redis()
        self.config = config
        self.row_bytes = row_bytes
        self.fingerprint = fingerprint
        self.hash_algo = hash_algo
        self.emit = emit
        self.namespace = f"{config.redis_key_prefix}{tier_namespace(fingerprint, config.mac_key)}:"
        self.stats = TierStats("redis")
        self.cluster = is_cluster(config.redis_url)
        self._connect = client_factory(config)  # checks the config now; builds the client on first use
        self._client: Any = None if self.cluster else self._connect()  # a server's client connects lazily
        self._where = where(config.redis_url)
        self._errors: tuple[type[BaseException], ...] = (
            redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)  # fmt: skip
        self._log = OnceLogger("redis")
        self._chunk = max(1, FETCH_CHUNK_BYTES // (HEADER_SIZE + row_bytes))
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which the tier is skipped
        self._down_since: float | None = None  # when the last failure was marked (None: up)
        self._writing: set[bytes] = set()  # keys a write job of this process is storing
        self._refused: OrderedDict[bytes, bytes] = OrderedDict()  # key -> the refused value's length and header
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="pagedkv-redis")
        self._inflight: set[Future[None]] = set()

    @property
    def client(self) -> Any:
        """The `redis.Redis` (or `RedisCluster`) of the tier, built on first use (a cluster client connects
        then, raising a Redis error the caller counts if the cluster cannot be reached)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def key(self, key: bytes) -> str:
        """The Redis key of page `key`."""
        return f"{self.namespace}{key.hex()}"

    # ----------------------------------------------------------------- health
    @property
    def available(self) -> bool:
        """False while the tier is skipped after a failure (`redis_retry_s`)."""
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        """Count and log (once) a failed operation; skip the tier for `redis_retry_s`."""
        self.stats.add(errors=1)
        with self._lock:
            self._down_since = now = time.monotonic()
            self._down_until = now + self.config.redis_retry_s
        self._log.error("down", f"redis tier: {what} on {self._where} failed ({type(exc).__name__}: {exc}); Redis "
                                f"is skipped for {self.config.redis_retry_s}s, pages are recomputed, serving "
                                "continues")  # fmt: skip

    def _succeeded(self, started: float) -> None:
        """An operation that started at `started` worked: log the recovery once if it followed a failure."""
        if self._down_since is None:
            return
        with self._lock:
            recovered = self._down_since is not None and started >= self._down_since
            if recovered:
                self._down_since = None
        if recovered:
            self._log.recovered("down", f"redis tier: {self._where} answers again; pages are shared again")

    # ----------------------------------------------------------------- reads
    def fetch(self, keys: Sequence[bytes], dest: Sequence[Row], done: Done | None = None) -> int:
        """Reads end with the call (socket timeouts): rows lent with `done` are all handed back before it returns."""
        if len(keys) != len(dest):
            raise ValueError(f"{len(keys)} keys but {len(dest)} destination rows")
        try:
            return self._fetch(keys, dest)
        finally:
            hand_back(done, len(dest))

    def _fetch(self, keys: Sequence[bytes], dest: Sequence[Row]) -> int:
        if not keys or not self.available:
            return 0
        started = time.monotonic()
        names = [self.key(k) for k in keys]
        count = 0
        try:
            mget = self.client.mget_nonatomic if self.cluster else self.client.mget  # cluster: MGET per slot
            for lo in range(0, len(keys), self._chunk):
                for value in mget(names[lo : lo + self._chunk]):
                    if value is None or not self._accept(keys[count], names[count], value, dest[count]):
                        self._succeeded(started)
                        return count
                    count += 1
        except self._errors as exc:
            self._failed("read", exc)
            return count
        self._succeeded(started)
        return count

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined EXISTS (per node for a cluster); all False while the tier is skipped or on an error."""
        if not keys or not self.available:
            return [False] * len(keys)
        started = time.monotonic()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(self.key(key))
                found = [bool(n) for n in pipe.execute()]
        except self._errors as exc:
            self._failed("lookup", exc)
            return [False] * len(keys)
        self._succeeded(started)
        return found

    def probe(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined GETRANGE (the header) + STRLEN per key (per node for a cluster): True where the
        page is there, one page long, with a header `check_header` accepts; a page that fails is
        refused (counted and logged once, left in place). All False while the tier is skipped or on an error."""
        if not keys or not self.available:
            return [False] * len(keys)
        started = time.monotonic()
        names = [self.key(k) for k in keys]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.getrange(name, 0, HEADER_SIZE - 1)
                    pipe.strlen(name)
                replies = pipe.execute()
            found = []
            for i, key in enumerate(keys):
                head, size = replies[2 * i], replies[2 * i + 1]
                if not size:
                    found.append(False)
                    continue
                version = _version(size, head)
                if self._refused.get(key) == version:
                    found.append(False)  # refused before, unchanged since
                    continue
                reason = check_header(decode_header(head), key, self.fingerprint, self.hash_algo, self.row_bytes,
                                      self.config.mac_key, size)  # fmt: skip
                found.append(reason is None or self._refuse(key, names[i], reason, version))
        except self._errors as exc:
            self._failed("lookup", exc)
            return [False] * len(keys)
        self._succeeded(started)
        return found

    def _accept(self, key: bytes, name: str, value: bytes, row: Row) -> bool:
        """Copy `value`'s row into `row` (a view, or its parts) if it is the valid page `key`; otherwise
        refuse it (a miss; the value stays)."""
        version = _version(len(value), value[:HEADER_SIZE])
        if self._refused.get(key) == version:
            return False  # refused before, unchanged since
        payload = memoryview(value)[HEADER_SIZE:]
        reason = check_page(decode_header(value), payload, key, self.fingerprint, self.hash_algo, self.row_bytes,
                            self.config.mac_key)  # fmt: skip
        if reason is None:
            at = 0
            for part in payload_parts(row):
                part[:] = payload[at : at + len(part)]
                at += len(part)
            return True
        return self._refuse(key, name, reason, version)

    def _refuse(self, key: bytes, name: str, reason: str, version: bytes) -> bool:
        """Count and log (once) a refused value and remember it (the same value is not counted again; this
        tier writes over it when it stores the page); the value stays on the server. False."""
        with self._lock:
            self._refused[key] = version
            self._refused.move_to_end(key)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
        self.stats.add(refused=1)
        self._log.error("refused", f"redis tier: refused {name}: {reason}; it is a miss (left in place) and the "
                                   "page is recomputed")  # fmt: skip
        return False

    # ----------------------------------------------------------------- writes
    def store(self, keys: Sequence[bytes], rows: Sequence[Row], done: Done, *, framed: bool = False) -> None:
        """A framed row is sealed in place and sent as the value itself (redis-py sends a memoryview
        without copying it); another row is joined with its header into one value."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        if framed:
            check_framed(rows, HEADER_SIZE + self.row_bytes)
        if not self.available:
            self.stats.add(skipped_writes=len(keys))
            for i in range(len(keys)):
                done(i)
            return
        todo: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._writing:
                    self._writing.add(key)
                    todo.append(i)
        for i in sorted(set(range(len(keys))) - set(todo)):
            done(i)  # another job of this process is writing that page
        size = max(1, -(-len(todo) // self.config.io_threads))
        for lo in range(0, len(todo), size):
            index = todo[lo : lo + size]
            future = self._pool.submit(self._write, [keys[i] for i in index], [rows[i] for i in index], index, done,
                                       framed)  # fmt: skip
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)

    def _write(self, keys: list[bytes], rows: list[Row], index: list[int], done: Done, framed: bool = False) -> None:
        """One pipelined EXISTS, then SET NX (EX ttl) of the missing pages; `done` once rows are copied
        (a framed row: once it is sent)."""
        started = time.monotonic()
        pending = list(index)  # rows whose `done` is not called yet
        stored = 0
        ttl = self.config.redis_ttl_s
        try:
            if not self.available:
                self.stats.add(skipped_writes=len(keys))
                return
            names = [self.key(k) for k in keys]
            refused = {self.key(k) for k in keys if k in self._refused}  # written over (this tier refused them)
            with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.exists(name)
                present = pipe.execute()
            values = {name: self._value(key, row, framed)
                      for key, row, name, there in zip(keys, rows, names, present, strict=True)
                      if not there or name in refused}  # fmt: skip
            if not framed:
                for i in pending:
                    done(i)  # every row is copied (or not needed): the caller may reuse it
                pending = []
            if values or ttl is not None:
                with self.client.pipeline(transaction=False) as pipe:
                    for name in names:
                        if name in values:
                            pipe.set(name, values[name], nx=name not in refused, ex=ttl)
                        elif ttl is not None:
                            pipe.expire(name, ttl)  # offered again: keep it for another ttl
                    results = pipe.execute()
                sent = [name for name in names if name in values or ttl is not None]
                stored = sum(1 for name, ok in zip(sent, results, strict=True) if name in values and ok)
        except self._errors as exc:
            self.stats.add(skipped_writes=len(keys))
            self._failed("write", exc)
        else:
            if refused:
                with self._lock:
                    for key, name in zip(keys, names, strict=True):
                        if name in refused:
                            self._refused.pop(key, None)
            if stored:
                self.stats.add(pages_stored=stored, bytes_stored=stored * self.row_bytes)
            self.stats.observe("store", time.monotonic() - started)
            self._succeeded(started)
        finally:
            for i in pending:
                done(i)
            with self._lock:
                self._writing.difference_update(keys)

    def _value(self, key: bytes, row: Row, framed: bool) -> bytes | memoryview:
        """The stored value of page `key`: a framed row sealed in place (sent as is), else header and
        row joined into new bytes."""
        mac_key = self.config.mac_key
        if framed:
            assert isinstance(row, memoryview)
            seal(row, key, self.fingerprint, self.hash_algo, mac_key)
            return row
        return b"".join((encode_header(key, row, self.fingerprint, self.hash_algo, mac_key), *payload_parts(row)))

    # ----------------------------------------------------------------- maintenance
    def wait(self) -> None:
        for future in list(self._inflight):
            future.result()

    def reset(self) -> int:
        """Delete every page of this prefix and layout on the server (every process's: SCAN + UNLINK);
        returns how many. 0 while the tier is skipped after a failure."""
        self.wait()
        if not self.available:
            return 0
        started = time.monotonic()
        deleted = 0
        removed: list[bytes] = []
        with self._lock:
            self._refused.clear()
        try:
            for count, names in unlink_prefix(self.client, self.namespace, SCAN_COUNT):
                deleted += count
                removed.extend(names)
        except self._errors as exc:
            self._failed("reset", exc)
        else:
            self._succeeded(started)
        if self.emit is not None and removed:
            self.emit(BlockRemoved([k for k in map(self._page_key, removed) if k is not None], self.medium))
        return deleted

    def _page_key(self, name: bytes) -> bytes | None:
        """The content hash in Redis key `name` (None if it is not one of ours)."""
        try:
            return bytes.fromhex(name.decode()[len(self.namespace) :])
        except ValueError:
            return None

    def shutdown(self) -> None:
        """Finish pending writes (each bounded by the timeouts; skipped once the server is found gone),
        stop the threads and close the connections."""
        self.wait()
        self._pool.shutdown(wait=True)
        if self._client is None:
            return
        try:
            self._client.close()
        except self._errors:
            pass


def _version(size: int, head: bytes | memoryview) -> bytes:
    """What tells one stored value of a page from another: its length and its header (which holds the tag)."""
    return size.to_bytes(8, "little") + bytes(head)
