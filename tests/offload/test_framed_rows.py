"""Framed rows (`LowerTier.store(framed=True)`) store the same page bytes as plain rows, and pages read
into a row given as parts are checked in place: a page written before framing existed reads the same."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer

from pagedkv.offload.disk import DiskTier
from pagedkv.offload.format import HEADER_SIZE, encode_header
from pagedkv.offload.redis_tier import RedisTier
from pagedkv.offload.tier import LowerTier
from pagedkv.params.connector import KVConnectorConfig

ROW = 3 * 4096
FINGERPRINT = b"f" * 16
MAC = b"a deployment secret!"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.running(tmp_path) as server:
        yield server


def _tier(kind: str, where: str, mac_key: bytes | None, server: RedisServer | None) -> LowerTier:
    if kind == "disk":
        return DiskTier(where, ROW, 1 << 20, FINGERPRINT, "sha256", threads=2, mac_key=mac_key)
    assert server is not None
    return RedisTier(KVConnectorConfig(redis_url=server.url, redis_key_prefix=f"{where}:", tier_hmac_key=mac_key),
                     ROW, FINGERPRINT, "sha256")  # fmt: skip


def _stored(kind: str, tier: LowerTier, key: bytes) -> bytes:
    if isinstance(tier, DiskTier):
        return tier.path(key).read_bytes()
    assert isinstance(tier, RedisTier)
    return bytes(tier.client.get(tier.key(key)))


@pytest.mark.parametrize("mac_key", [None, MAC], ids=["checksum", "hmac"])
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_framed_rows_store_the_same_pages(kind: str, mac_key: bytes | None, tmp_path: Path, request: pytest.FixtureRequest) -> None:  # fmt: skip
    server = request.getfixturevalue("redis_server") if kind == "redis" else None
    plain = _tier(kind, str(tmp_path / "plain"), mac_key, server)
    framed = _tier(kind, str(tmp_path / "framed"), mac_key, server)
    keys = [os.urandom(32) for _ in range(3)]
    payloads = [os.urandom(ROW) for _ in keys]
    pages = [memoryview(bytearray(HEADER_SIZE) + p) for p in payloads]
    done: list[int] = []
    plain.store(keys, [memoryview(p) for p in payloads], done.append)
    framed.store(keys, pages, done.append, framed=True)
    plain.wait()
    framed.wait()
    assert sorted(done) == [0, 0, 1, 1, 2, 2]
    for key, payload in zip(keys, payloads, strict=True):
        want = encode_header(key, payload, FINGERPRINT, "sha256", mac_key) + payload  # the format, byte for byte
        assert _stored(kind, plain, key) == _stored(kind, framed, key) == want
    # read back into rows given as parts (as the vLLM connector reads into the KV blocks' layer slices)
    dest = [[memoryview(bytearray(4096)) for _ in range(3)] for _ in keys]
    assert framed.fetch(keys, dest) == 3
    assert [b"".join(bytes(p) for p in row) for row in dest] == payloads
    with pytest.raises(ValueError, match="framed row must be one writable view"):
        framed.store(keys[:1], [memoryview(payloads[0])], done.append, framed=True)  # no header room
    plain.shutdown()
    framed.shutdown()


def test_a_damaged_page_read_into_parts_is_refused(tmp_path: Path) -> None:
    tier = _tier("disk", str(tmp_path), None, None)
    keys = [os.urandom(32) for _ in range(2)]
    tier.store(keys, [memoryview(bytearray(HEADER_SIZE) + os.urandom(ROW)) for _ in keys], lambda i: None, framed=True)
    tier.wait()
    raw = bytearray(tier.path(keys[1]).read_bytes())
    raw[HEADER_SIZE + 5000] ^= 1
    tier.path(keys[1]).write_bytes(raw)
    dest = [[memoryview(bytearray(ROW // 2)) for _ in range(2)] for _ in keys]
    assert tier.fetch(keys, dest) == 1 and tier.stats.refused == 1
    tier.shutdown()
