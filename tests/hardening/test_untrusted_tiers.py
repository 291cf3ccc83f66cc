"""Shared tiers are untrusted: forged pages, planted links and hostile key prefixes.

A forger here can write to the disk directory or the Redis server but does not hold `tier_hmac_key`.
It writes a page with a valid header and checksum over values of its choosing under the key of a
prompt's first page. Without a key the checksum cannot tell (the test shows the stamp model catching
the wrong KV: the threat is real); with a key the page is refused, counted, deleted and recomputed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import make_params
from offload.redis_server import RedisServer
from pagedkv.connector_config import KVConnectorConfig
from pagedkv.core.context import TextContext
from pagedkv.core.hashing import hash_tokens
from pagedkv.manager.paged import PagedKVCacheManager
from pagedkv.offload.format import HEADER_SIZE, encode_header
from pagedkv.testing import PrefixStampModel

PROMPT = list(range(1, 30))
KEY = b"deployment-secret-0123456789"


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


def _serve(mgr: PagedKVCacheManager, rid: int) -> int:
    """Serve PROMPT + 2 tokens under the stamp model (which checks every cached position); returns hits."""
    model, c = PrefixStampModel(mgr), TextContext(rid, np.asarray(PROMPT))
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


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_keyed_and_unkeyed_engines_do_not_share_a_namespace(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    redis = request.getfixturevalue("redis_server") if kind == "redis" else None
    where = redis.url if redis else str(tmp_path)
    if redis is not None:
        redis.client().flushall()
    unkeyed, keyed = _manager(kind, where, None), _manager(kind, where, KEY)
    other_key = _manager(kind, where, b"another-deployment-key")
    assert _serve(unkeyed, 0) == 0
    assert _serve(keyed, 1) == 0  # nothing unsigned is even looked at
    assert _serve(other_key, 2) == 0
    stats = other_key.tier_stats()[kind]  # pages signed with `KEY`: refused (a batch may check several)
    assert stats["refused"] >= 1 and stats["pages_loaded"] == 0
    for m in (unkeyed, keyed, other_key):
        m.close()


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
