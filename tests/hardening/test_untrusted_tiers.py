"""Shared tiers are untrusted: forged pages, planted links and hostile key prefixes.

A forger here can write to the disk directory or the Redis server but does not hold `tier_hmac_key`.
It writes a page with a valid header and checksum over values of its choosing under the key of a
prompt's first page. Without a key the checksum cannot tell (the test shows the stamp model catching
the wrong KV: the threat is real); with a key the page is refused, counted and recomputed.

A page a reader cannot verify is a miss for that reader, never deleted by it: engines with another key
(or none) use another namespace and never even look at the deployment's pages; a page refused in one's own
namespace stays until the size cap, an expiry or a reset removes it, or the refusing tier writes the page
it computed again over it. Planted files that are not regular files (a FIFO, a directory) are misses that
never block a read.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import make_params
from offload.redis_server import RedisServer
from pagedkv.core.context import TextContext
from pagedkv.core.hashing import hash_tokens
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.offload.disk import DiskTier
from pagedkv.offload.format import HEADER_SIZE, encode_header, key_id, tier_namespace
from pagedkv.offload.redis_tier import RedisTier
from pagedkv.offload.tier import LowerTier
from pagedkv.params.connector import KVConnectorConfig
from pagedkv.testing import PrefixStampModel

PROMPT = list(range(1, 30))
LONG = list(range(1, 42))  # 41 tokens: 10 full pages of 4, so a hit serves 40 cached tokens
KEY = b"deployment-secret-0123456789"
OTHER_KEY = b"another-deployment-key"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.running(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _manager(kind: str, where: str, mac_key: bytes | None) -> PagedKVCacheManager:
    if kind == "disk":
        cfg = KVConnectorConfig(disk_offload_dir=where, tier_hmac_key=mac_key)
        extra: dict[str, Any] = dict(kv_connector="tiered", host_kvcache_swap_space_gb=0.001)
    else:
        cfg = KVConnectorConfig(redis_url=where, redis_key_prefix="untrusted:", tier_hmac_key=mac_key)
        extra = dict(kv_connector="redis")
    params = make_params(n_kv_heads=2, head_dim=4, num_layers=2, page_size=4, enable_prefix_caching=True,
                         kv_connector_config=cfg, **extra)  # fmt: skip
    return PagedKVCacheManager(params, None, 16, total_num_host_pages=0, max_batch_size=2, enable_runtime_checks=True)


def _serve(mgr: PagedKVCacheManager, rid: int, prompt: list[int] = PROMPT) -> int:
    """Serve `prompt` + 2 tokens under the stamp model (which checks every cached position); returns hits."""
    model, c = PrefixStampModel(mgr), TextContext(rid, np.asarray(prompt))
    mgr.claim(rid)
    cached = -1
    for t in range(2):
        mgr.alloc(c)
        cached = c.cached_prefix_length if cached < 0 else cached
        model.forward([[c]])
        c.update(1000 + t)
        mgr.step([[c]])
    mgr.release(rid)
    mgr.sync_tiers()
    return cached


def _forge_first_page(mgr: PagedKVCacheManager, redis: RedisServer | None) -> None:
    """Overwrite the stored first page of PROMPT with zeros under a valid, unsigned header."""
    tier = mgr.tiers.connectors[0].lower[0]
    key = hash_tokens(PROMPT, 4, seed=mgr.params.kv_hash_seed)[0]
    payload = bytes(tier.row_bytes)  # K = V = 0: not this prefix's values
    value = encode_header(key, payload, tier.fingerprint, "sha256") + payload
    if redis is None:
        Path(tier.path(key)).write_bytes(value)
    else:
        redis.client().set(tier.key(key), value)


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_forged_page_is_loaded_without_a_key_and_refused_with_one(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    redis = request.getfixturevalue("redis_server") if kind == "redis" else None
    where = redis.url if redis else str(tmp_path)
    for mac_key in (None, KEY):
        if redis is not None:
            redis.client().flushall()
        writer = _manager(kind, where, mac_key)
        assert _serve(writer, 0) == 0
        _forge_first_page(writer, redis)
        writer.close()
        reader = _manager(kind, where, mac_key)  # another engine, empty device: hits come from the tier
        if mac_key is None:  # a checksum is no defence against a writer: the wrong KV reaches attention
            with pytest.raises(AssertionError, match="holds another prefix's KV"):
                _serve(reader, 1)
            reader.close()
            continue
        assert _serve(reader, 1) == 0  # the forged first page is refused, so the chain misses from page 0
        stats = reader.tier_stats()[kind]
        assert stats["refused"] == 1 and stats["pages_loaded"] == 0
        assert _serve(reader, 2) == 28  # (its own recomputed pages, on device; they were also written, signed)
        reader.close()
        third = _manager(kind, where, mac_key)
        assert _serve(third, 3) == 28 and third.tier_stats()[kind]["refused"] == 0  # genuine pages: all hits
        third.close()


def _namespace_contents(tier: LowerTier, redis: RedisServer | None) -> dict[str, bytes]:
    """Every page file (or Redis value) of `tier`'s namespace, by name."""
    if redis is None:
        assert isinstance(tier, DiskTier)
        return {str(p.relative_to(tier.root)): p.read_bytes() for p in tier.root.rglob("*.page")}
    assert isinstance(tier, RedisTier)
    client = redis.client()
    return {name.decode(): client.get(name) for name in client.keys(tier.namespace.encode() + b"*")}


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_an_engine_with_another_key_never_touches_the_deployments_pages(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An engine with the wrong `tier_hmac_key` (and one with none) on the deployment's directory or Redis: 0 hits
    for it, nothing of the deployment's read, refused, deleted or written over, and the deployment's engines still
    get all 40 cached tokens afterwards."""
    redis = request.getfixturevalue("redis_server") if kind == "redis" else None
    where = redis.url if redis else str(tmp_path)
    if redis is not None:
        redis.client().flushall()
    first = _manager(kind, where, KEY)
    assert _serve(first, 0, LONG) == 0
    tier = first.tiers.connectors[0].lower[0]
    before = _namespace_contents(tier, redis)
    assert len(before) == 10
    first.close()
    for rid, other in enumerate((OTHER_KEY, None), start=1):
        mgr = _manager(kind, where, other)
        assert _serve(mgr, rid, LONG) == 0
        stats = mgr.tier_stats()[kind]  # the deployment's pages are not even looked at: another namespace
        assert (stats["refused"], stats["pages_loaded"], stats["pages_stored"]) == (0, 0, 10)
        mgr.close()
    assert _namespace_contents(tier, redis) == before  # nothing deleted, nothing written over
    again = _manager(kind, where, KEY)
    assert _serve(again, 4, LONG) == 40 and again.tier_stats()[kind]["refused"] == 0
    again.close()
    names = [p.name for p in tmp_path.iterdir()] if redis is None else [n.decode() for n in redis.client().keys("*")]
    assert not any(secret.hex() in name or secret.decode() in name for name in names for secret in (KEY, OTHER_KEY))


def test_the_key_id_is_stable_one_way_and_names_the_namespace(tmp_path: Path) -> None:
    """`key_id` is 16 hex characters of HMAC-SHA256(key, a fixed label): the same for every engine and version
    (pinned here), another for another key, and nothing of the key itself; it names the key's namespace."""
    assert key_id(KEY) == "825d3c8905aefadb"
    assert key_id(KEY) == hmac.new(KEY, b"pagedkv tier key id\x00v1", hashlib.sha256).hexdigest()[:16]
    assert key_id(OTHER_KEY) != key_id(KEY) and len(key_id(OTHER_KEY)) == 16
    assert key_id(KEY) not in KEY.hex() and key_id(KEY) != hashlib.sha256(KEY).hexdigest()[:16]
    fingerprint = bytes(range(16))
    assert tier_namespace(fingerprint, None) == fingerprint.hex()
    assert tier_namespace(fingerprint, KEY) == f"{fingerprint.hex()}-825d3c8905aefadb"
    mgr = _manager("disk", str(tmp_path), KEY)
    tier = mgr.tiers.connectors[0].lower[0]
    assert isinstance(tier, DiskTier) and tier.root.name == tier_namespace(tier.fingerprint, KEY)
    assert tier.key_id == key_id(KEY)
    mgr.close()


def _pair(kind: str, where: str, row: int) -> tuple[LowerTier, LowerTier, LowerTier]:
    """Three tiers of one namespace (three processes' worth), pages signed with KEY."""
    if kind == "disk":
        return tuple(DiskTier(where, row, 1 << 20, bytes(16), "sha256", threads=2, mac_key=KEY) for _ in range(3))  # type: ignore[return-value]
    config = KVConnectorConfig(redis_url=where, redis_key_prefix="kept:", tier_hmac_key=KEY)
    return tuple(RedisTier(config, row, bytes(16), "sha256") for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_page_a_reader_refuses_stays_until_its_recompute_writes_over_it(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """One flipped payload byte: the reader refuses the page (counted once, however often it looks), deletes and
    changes nothing; a writer that did not refuse it skips it (it is there); the tier that refused it writes the
    page it computed again over it, and everyone loads that."""
    redis = request.getfixturevalue("redis_server") if kind == "redis" else None
    where = redis.url if redis else str(tmp_path)
    if redis is not None:
        redis.client().flushall()
    writer, reader, other = _pair(kind, where, 64)
    key, row = bytes([7]) * 32, bytes(range(64))
    writer.store([key], [memoryview(row)], lambda i: None)
    writer.wait()

    def raw() -> bytes | None:
        if isinstance(writer, DiskTier):
            path = writer.path(key)
            return path.read_bytes() if path.exists() else None
        assert redis is not None and isinstance(writer, RedisTier)
        return redis.client().get(writer.key(key))  # type: ignore[no-any-return]

    good = raw()
    assert good is not None and len(good) == HEADER_SIZE + 64
    damaged = good[: HEADER_SIZE + 9] + bytes([good[HEADER_SIZE + 9] ^ 1]) + good[HEADER_SIZE + 10 :]
    if isinstance(writer, DiskTier):
        writer.path(key).write_bytes(damaged)
    else:
        assert redis is not None and isinstance(writer, RedisTier)
        redis.client().set(writer.key(key), damaged)
    dest = bytearray(64)
    for _ in range(2):
        assert reader.fetch([key], [memoryview(dest)]) == 0 and reader.probe([key]) == [False]
    assert reader.stats.refused == 1 and raw() == damaged  # counted once; not deleted, not changed
    other.store([key], [memoryview(row)], lambda i: None)
    other.wait()
    assert raw() == damaged and other.stats.pages_stored == 0  # a page that is there is not written again
    reader.store([key], [memoryview(row)], lambda i: None)
    reader.wait()
    assert raw() == good and reader.stats.pages_stored == 1  # the refusing tier's recompute writes over it
    assert other.fetch([key], [memoryview(dest)]) == 1 and bytes(dest) == row and other.stats.refused == 0
    for tier in (writer, reader, other):
        tier.shutdown()


def _release_fifo(path: Path) -> None:
    """Wake a reader blocked opening the FIFO at `path` (it then reads an empty page)."""
    for _ in range(100):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                return
            threading.Event().wait(0.01)


@pytest.mark.parametrize("planted", ["fifo", "directory", "link to a fifo"])
def test_a_page_that_is_not_a_regular_file_is_a_miss_and_never_blocks(tmp_path: Path, planted: str) -> None:
    """A FIFO (or a directory, or a link to a FIFO) at the name of a prompt's third page: `alloc` returns, the
    first two pages load, the third is a refused miss and the rest is computed. (The serving thread has a
    deadline, so a reader that blocks fails the test instead of hanging it.)"""
    directory = tmp_path / "tier"
    mgr = _manager("disk", str(directory), None)
    assert _serve(mgr, 0) == 0
    page = Path(mgr.tiers.connectors[0].lower[0].path(hash_tokens(PROMPT, 4, seed=mgr.params.kv_hash_seed)[2]))
    mgr.close()
    page.unlink()
    fifo = page if planted == "fifo" else tmp_path / "fifo"
    if planted == "directory":
        page.mkdir()
    else:
        os.mkfifo(fifo)
        if planted == "link to a fifo":
            page.symlink_to(fifo)
    reader = _manager("disk", str(directory), None)
    served: dict[str, int] = {}
    thread = threading.Thread(target=lambda: served.update(cached=_serve(reader, 1)), daemon=True)
    thread.start()
    thread.join(60)
    blocked = thread.is_alive()
    if blocked and planted != "directory":
        _release_fifo(fifo)
        thread.join(60)
    assert not blocked, f"a {planted} at a page's name blocked the reader"
    stats = reader.tier_stats()["disk"]
    assert served["cached"] == 8 and stats["pages_loaded"] == 2 and stats["refused"] == 1
    if planted == "directory":  # the recompute cannot replace a directory: its write fails, counted
        assert page.is_dir() and stats["errors"] == stats["skipped_writes"] == 1
    else:  # the recompute replaced the planted name with the page (the FIFO a link pointed to is untouched)
        assert stat.S_ISREG(page.lstat().st_mode) and stats["errors"] == 0
        assert stat.S_ISFIFO(fifo.lstat().st_mode) or planted == "fifo"
    reader.close()


def test_disk_tier_never_follows_links_out_of_its_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "00.1.tmp").write_text("keep me too")  # a name the tier would delete as its own leftover
    mgr = _manager("disk", str(tmp_path / "tier"), None)
    tier = mgr.tiers.connectors[0].lower[0]
    assert _serve(mgr, 0) == 0
    key = hash_tokens(PROMPT, 4, seed=mgr.params.kv_hash_seed)[0]
    page = Path(tier.path(key))
    target = outside / "page-copy"
    target.write_bytes(page.read_bytes())
    page.unlink()
    page.symlink_to(target)  # a planted link at a page's name, to a file outside (a valid page, even)
    bucket = next(f"{b:02x}" for b in range(256) if not (tier.root / f"{b:02x}").exists())
    os.symlink(outside, tier.root / bucket)  # a planted bucket that is a link to a directory outside
    mgr.close()
    reader = _manager("disk", str(tmp_path / "tier"), None)  # the restart scan sees both links
    assert _serve(reader, 1) == 0  # the linked page is refused (not followed), so page 0 misses
    assert reader.tier_stats()["disk"]["refused"] == 1 and not page.is_symlink()
    reader.close()
    assert (outside / "precious.txt").read_text() == "keep me" and (outside / "00.1.tmp").exists()
    assert target.read_bytes()[:4] == b"PKVP" and (tier.root / bucket).is_symlink()


def test_page_names_stay_inside_the_directory_and_prefix(tmp_path: Path, redis_server: RedisServer) -> None:
    """Names are built only from a fingerprint and a content hash in hex, whatever the key bytes."""
    mgr = _manager("disk", str(tmp_path), None)
    tier = mgr.tiers.connectors[0].lower[0]
    for key in (b"../../etc/passwd", b"\x00/..", bytes(range(32))):
        path = Path(tier.path(key)).resolve()
        assert path.is_relative_to(tier.root.resolve()) and path.name == key.hex() + ".page"
    mgr.close()
    client = redis_server.client()
    client.flushall()
    client.set("victim:data", b"x")
    client.set("untrusted-data", b"y")  # matches the prefix "untrusted*" as a glob, not as a prefix
    glob_prefix = "untrusted*"
    params = make_params(n_kv_heads=2, head_dim=4, num_layers=2, page_size=4, enable_prefix_caching=True,
                         kv_connector="redis", kv_connector_config=KVConnectorConfig(
                             redis_url=redis_server.url, redis_key_prefix=glob_prefix))  # fmt: skip
    writer = PagedKVCacheManager(params, None, 16, max_batch_size=2)
    assert _serve(writer, 0) == 0
    names = {n.decode() for n in client.keys("*")} - {"victim:data", "untrusted-data"}
    assert names and all(n.startswith(glob_prefix) and len(n.split(":")[-1]) == 64 for n in names)
    writer.reset_prefix_cache()  # SCAN + UNLINK of this prefix only
    assert sorted(client.keys("*")) == [b"untrusted-data", b"victim:data"]
    writer.close()
    assert HEADER_SIZE == 112
