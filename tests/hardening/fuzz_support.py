"""Shared parts of the stateful fuzzers (`test_stateful_tiers.py` with `fuzz_tier_rules.py`,
`test_stateful_engine.py` with `fuzz_engine_support.py`) and of their plain tests (`test_fuzz_regressions.py`).

- `shared_redis()`: one real redis-server for a whole test module (started on first use, stopped by
  `stop_shared_redis()`), restartable on the same port; absent redis-server means the "redis"
  connector is left out of the draws, unless PAGEDKV_REQUIRE_REDIS=1, where the tests fail.
- Tier faults done for real: `disk_fault` edits the page files of a disk tier, `redis_fault` the
  values of a Redis tier (flip a byte, truncate, delete, garbage, another page's bytes, a forged page).
- `wait_for_each_offload`: the manager machine's tier transfers run one at a time (a deterministic machine);
- `check_request_kv`: the shadow model of the manager machine; every position a request has processed
  must hold `prefix_values` of its own tokens (what `PrefixStampModel` wrote), read straight from the
  page buffers of every TP shard.
- `FuzzReport`: operation counters of one machine, appended as JSON to $PAGEDKV_FUZZ_REPORT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

_TESTS = Path(__file__).resolve().parent.parent
for _sub in ("manager", "offload"):  # test_stateful (ManagerMachine) and redis_server (RedisServer)
    if str(_TESTS / _sub) not in sys.path:
        sys.path.append(str(_TESTS / _sub))

from pagedkv.offload import format as page_format  # noqa: E402
from pagedkv.params.connector import KVConnectorConfig  # noqa: E402
from pagedkv.testing import prefix_values  # noqa: E402

T = TypeVar("T")
EXAMPLES = int(os.environ.get("PAGEDKV_FUZZ_EXAMPLES", "60"))  # the default of tests/manager/test_stateful.py
REQUIRE_REDIS = os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1"


# ----------------------------------------------------------------------------- Redis
def redis_available() -> bool:
    """redis-server on PATH and redis-py importable."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return shutil.which("redis-server") is not None


REDIS = redis_available()

_server: Any = None
_server_dir: str | None = None


def require_redis_or_skip_connector() -> None:
    """Called by each module's fixture: without Redis, fail under PAGEDKV_REQUIRE_REDIS=1 (CI);
    otherwise the machines simply do not draw the "redis" connector."""
    if not REDIS and REQUIRE_REDIS:
        pytest.fail("redis-server (and redis-py) are needed for the redis connector, and PAGEDKV_REQUIRE_REDIS=1")


def shared_redis() -> Any:
    """The module's redis-server (a `tests/offload/redis_server.RedisServer`), started on first use and
    running when returned (restarted if a rule left it stopped)."""
    global _server, _server_dir
    from redis_server import RedisServer

    if _server is None:
        _server_dir = tempfile.mkdtemp(prefix="pagedkv-fuzz-redis-")
        _server = RedisServer(Path(_server_dir))
    if _server.proc is None or _server.proc.poll() is not None:
        _server.start()
    return _server


def stop_shared_redis() -> None:
    global _server, _server_dir
    if _server is not None:
        _server.stop()
        _server = None
    if _server_dir is not None:
        shutil.rmtree(_server_dir, ignore_errors=True)
        _server_dir = None


def redis_is_up() -> bool:
    return _server is not None and _server.proc is not None and _server.proc.poll() is None


def redis_keys(client: Any, prefix: str) -> list[bytes]:
    """Every key under `prefix`, sorted (so a draw by index is reproducible)."""
    return sorted(client.scan_iter(match=prefix + "*", count=1000))


def drop_redis_prefix(prefix: str) -> None:
    """Delete the keys of one example (the server is shared by the module)."""
    if not redis_is_up():
        return
    client = _server.client()
    try:
        names = redis_keys(client, prefix)
        if names:
            client.unlink(*names)
    finally:
        client.close()


# ----------------------------------------------------------------------------- HMAC (landing concurrently)
HMAC_FIELD = "tier_hmac_key"


def hmac_supported() -> bool:
    """True once `KVConnectorConfig` has `tier_hmac_key` (pages authenticated with a secret key)."""
    return HMAC_FIELD in {f.name for f in dataclasses.fields(KVConnectorConfig)}


def hmac_kwargs(seed: int) -> dict[str, Any]:
    """`{tier_hmac_key: ...}` for KVConnectorConfig when the field exists (bytes, else a hex str)."""
    if not hmac_supported():
        return {}
    key = seed.to_bytes(4, "little") * 8  # 32 bytes
    for value in (key, key.hex()):
        try:
            KVConnectorConfig(**{HMAC_FIELD: value})
        except (TypeError, ValueError):
            continue
        return {HMAC_FIELD: value}
    return {}


def has_hmac(config: KVConnectorConfig | None) -> bool:
    return config is not None and getattr(config, HMAC_FIELD, None) not in (None, b"", "")


# ----------------------------------------------------------------------------- faults
DISK_FAULTS = ("flip_payload", "flip_header", "truncate", "delete_some", "other_page", "garbage", "wipe_dir")
REDIS_FAULTS = ("flip_payload", "truncate", "delete_some", "other_page", "garbage", "flushall")


def disk_page_files(root: Path) -> list[Path]:
    """The stored page files under a disk tier directory, sorted."""
    return sorted(p for p in root.rglob("*.page") if p.is_file())


def _flip(raw: bytearray, lo: int, hi: int, pick: int) -> None:
    hi = min(hi, len(raw))  # a page an earlier fault truncated
    if hi > lo:
        raw[lo + pick % (hi - lo)] ^= 0xFF


def mutate(raw: bytes, kind: str, pick: int, row_bytes: int, other: bytes | None) -> bytes | None:
    """The stored bytes of one page after fault `kind` (None: delete it). `pick` chooses where."""
    header = len(raw) - row_bytes if len(raw) > row_bytes else page_format.HEADER_SIZE
    out = bytearray(raw)
    if kind == "flip_payload":
        _flip(out, header, len(out), pick)
    elif kind == "flip_header":
        _flip(out, 0, header, pick)
    elif kind == "truncate":
        return bytes(out[: pick % max(1, len(out))])
    elif kind == "other_page":  # a valid page of another prefix under this name: its header names the other key
        return other if other is not None else bytes(out[:header])
    elif kind == "garbage":
        return np.random.default_rng(pick).integers(0, 256, size=pick % (2 * len(out) + 1), dtype=np.uint8).tobytes()
    else:
        raise ValueError(kind)
    return bytes(out)


def forge(victim: bytes, donor: bytes, row_bytes: int, downgrade: bool = True) -> bytes:
    """What an attacker who can write the tier but has no secret key can make: `victim`'s header (its
    key, layout, anything else it carries) over `donor`'s payload (another prefix's KV). `downgrade`:
    the header's integrity field says "checksum" and holds the payload's valid checksum (the public
    format's checks all pass); otherwise the victim's own tag stays (a signature over other bytes)."""
    head, payload = bytearray(victim[: len(victim) - row_bytes]), donor[len(donor) - row_bytes :]
    if downgrade and len(head) >= 76:
        head[7] = page_format.DEFAULT_CHECKSUM  # integrity algorithm: a plain checksum
        struct.pack_into("<Q", head, 68, page_format.checksum(payload))  # the tag starts at 68 (v1 and v2)
        head[76 : min(len(head), 100)] = bytes(max(0, min(len(head), 100) - 76))  # v2: rest of the tag zero
    return bytes(head) + payload


def _two(items: list[T], picks: list[int]) -> tuple[T, T | None]:
    """The item `picks[0]` chooses and, when there are two or more, another one (from `picks[1]`)."""
    first = picks[0] % len(items)
    if len(items) < 2 or len(picks) < 2:
        return items[first], None
    return items[first], items[(first + 1 + picks[1] % (len(items) - 1)) % len(items)]


def disk_fault(root: Path, kind: str, picks: list[int], row_bytes: int) -> int:
    """Apply `kind` to the page files under `root`; returns how many files it touched."""
    files = disk_page_files(root)
    if kind == "wipe_dir":
        shutil.rmtree(root, ignore_errors=True)
        return len(files)
    if not files:
        return 0
    if kind == "delete_some":
        chosen = {files[p % len(files)] for p in picks}
        for path in chosen:
            path.unlink(missing_ok=True)
        return len(chosen)
    path, other = _two(files, picks)
    try:
        raw = path.read_bytes()
        donor = other.read_bytes() if other is not None and other != path else None
    except FileNotFoundError:  # deleted by the tier meanwhile (LRU)
        return 0
    new = _damaged(raw, donor, kind, picks, row_bytes)
    if new is None:
        return 0
    path.write_bytes(new)  # in place, as a bad disk or another writer would leave it
    return 1


def redis_fault(client: Any, prefix: str, kind: str, picks: list[int], row_bytes: int) -> int:
    """Apply `kind` to this example's values in Redis; returns how many values it touched."""
    if kind == "flushall":
        client.flushall()
        return 1
    names = redis_keys(client, prefix)
    if not names:
        return 0
    if kind == "delete_some":
        chosen = sorted({names[p % len(names)] for p in picks})
        client.unlink(*chosen)
        return len(chosen)
    name, other = _two(names, picks)
    raw = client.get(name)
    donor = client.get(other) if other is not None and other != name else None
    if raw is None:
        return 0
    new = _damaged(raw, donor, kind, picks, row_bytes)
    if new is None:
        return 0
    client.set(name, new)
    return 1


def _damaged(raw: bytes, donor: bytes | None, kind: str, picks: list[int], row_bytes: int) -> bytes | None:
    """`raw` after fault `kind` (None: a forgery with no donor page to forge from)."""
    if kind == "forge":
        return None if donor is None else forge(raw, donor, row_bytes, downgrade=picks[-1] % 4 != 0)
    new = mutate(raw, kind, picks[0] + 7 * picks[-1], row_bytes, donor)
    assert new is not None
    return new


# ----------------------------------------------------------------------------- determinism
def wait_for_each_offload(conn: Any) -> None:
    """Make connector `conn`'s transfers run one after the other: `offload` returns once the transfers it
    started are done (the copy into host rows, the writes below), and each lower tier's `store` once its
    writes are. Otherwise thread timing decides what the tiers hold: `runtime_inputs` offloads one run of
    pages per request that committed some, and a later run finds the host rows of an earlier one still
    pinned by its writes (it skips, or evicts others) or not; one offload's host-row and staged writes
    reach the disk tier as two `store` calls, and the second one's pages count against the cap in the
    first one's writes or not (other victims). Hits, the machine's state and so its draws would then
    differ between two runs of one example, which Hypothesis reports as a flaky strategy."""
    offload = conn.offload

    def offload_and_wait(*args: Any, **kwargs: Any) -> None:
        offload(*args, **kwargs)
        conn.flush()

    conn.offload = offload_and_wait
    for tier in conn.lower:
        _store_and_wait(tier)


def _store_and_wait(tier: Any) -> None:
    store = tier.store

    def store_and_wait(*args: Any, **kwargs: Any) -> None:
        store(*args, **kwargs)
        tier.wait()

    tier.store = store_and_wait


# ----------------------------------------------------------------------------- shadow model
def check_request_kv(mgr: Any, ctx: Any, replica_idx: int = 0) -> int:
    """Every processed position of claimed `ctx` holds its own prefix's KV in every TP shard (K =
    prefix_values, V = K + 1, on every layer and head, as `PrefixStampModel` writes them). Returns the
    number of positions checked. Pages a tier load staged at `alloc` are skipped: their copies run at
    the next forward (`runtime_inputs`), whose `PrefixStampModel` check reads them."""
    cached = ctx.tokens.processed_length
    if not cached:
        return 0
    ps = mgr.page_size
    table = np.asarray(mgr.get_req_blocks(ctx.request_id, replica_idx), dtype=np.int64)
    pos = np.arange(cached)
    assert len(table) * ps >= cached, f"{ctx.request_id!r}: {len(table)} pages for {cached} processed tokens"
    connectors = mgr.tiers.connectors if hasattr(mgr, "tiers") else []
    staged = connectors[replica_idx].staged.pages if connectors else frozenset()
    if staged:
        pos = pos[~np.isin(table[pos // ps], sorted(staged))]
    cached = len(pos)
    if not cached:
        return 0
    pages, slots = table[pos // ps], pos % ps
    want = prefix_values(ctx.tokens.all[: int(pos[-1]) + 1]).astype(np.float32)[pos]
    import torch

    idx_p, idx_s = torch.from_numpy(pages), torch.from_numpy(slots)
    want_t = torch.from_numpy(want).view(-1, 1, 1, 1)
    buffer = mgr.get_device_buffer(replica_idx)
    for shard, values in enumerate(buffer.values):  # [pages + 1, kv, L, ps, H, D]
        got = values[idx_p, 0, :, idx_s]  # [cached, L, H, D]
        bad = (got != want_t.expand_as(got)).reshape(cached, -1).any(1).nonzero().flatten().tolist()
        assert not bad, (
            f"request {ctx.request_id!r}, shard {shard}: positions {[int(pos[b]) for b in bad[:8]]} (pages "
            f"{sorted({int(pages[b]) for b in bad})[:8]}) do not hold their prefix's K"
        )
        if values.shape[1] == 2:
            got_v = values[idx_p, 1, :, idx_s]
            assert torch.equal(got_v, (want_t + 1).expand_as(got_v)), f"request {ctx.request_id!r}: V differs from K+1"
    return cached


# ----------------------------------------------------------------------------- report
@dataclasses.dataclass
class FuzzReport:
    """Counters of one machine over a test module; `write()` appends them to $PAGEDKV_FUZZ_REPORT."""

    machine: str
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    maxima: dict[str, float] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def start(self) -> None:
        """Time from now (the module's first test), not from the import."""
        self.started = time.perf_counter()

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.counters[name] = self.counters.get(name, 0) + int(n)

    def maximum(self, **values: float) -> None:
        for name, value in values.items():
            self.maxima[name] = max(self.maxima.get(name, value), value)

    def write(self, **extra: Any) -> None:
        path = os.environ.get("PAGEDKV_FUZZ_REPORT")
        if not path or not self.counters:
            return
        entry = {
            "machine": self.machine,
            **dict(sorted(self.counters.items())),
            **self.maxima,
            "wall_seconds": round(time.perf_counter() - self.started, 2),
            "PAGEDKV_FUZZ_EXAMPLES": EXAMPLES,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **extra,
        }
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        runs: list[Any] = []
        if target.exists():
            try:
                loaded = json.loads(target.read_text() or "[]")
                runs = loaded if isinstance(loaded, list) else [loaded]
            except json.JSONDecodeError:
                runs = []
        runs.append(entry)
        target.write_text(json.dumps(runs, indent=1) + "\n")
