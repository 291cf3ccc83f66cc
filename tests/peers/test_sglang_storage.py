"""`PagedKVStorage` inside SGLang 0.5.23's real HiCache storage machinery (run in `.venv-peers`).

SGLang's `StorageBackendFactory.create_backend("dynamic", ...)` builds the backend, SGLang's
`MHATokenToKVPoolHost` (CPU, not pinned) holds the pages, and pages move between the host pool and
a real medium: a directory, or a `redis-server` started per test (tests/offload/redis_server.py).
Device<->host copies need SGLang's CUDA kernels, so every test starts from the host pool. Without
SGLang the tests skip (fail under PAGEDKV_REQUIRE_PEERS=1); without redis-server or redis-py the
Redis cases skip (fail under PAGEDKV_REQUIRE_REDIS=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_storage_support import PAGE, backend, host_pool, page_bytes, page_keys, sglang, slots, storage_config

from pagedkv.integrations.sglang.keys import page_key
from pagedkv.offload.format import HEADER_SIZE, decode_header

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "offload"))
from redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ["page_first", "page_first_direct", "page_head", "layer_first"]
ROW_BYTES = 2 * 3 * PAGE * 2 * 8 * 2  # K and V x 3 layers x 4 tokens x 2 heads x 8 dims x bf16 = 768


def _require_redis_py() -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
            pytest.fail("redis-py is not importable here, and PAGEDKV_REQUIRE_REDIS=1")
        pytest.skip("redis-py is not installed in this environment (pip install redis)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    _require_redis_py()
    with RedisServer.running(tmp_path) as server:
        yield server


class Medium:
    """One medium under test: the extra_config keys that select it, and raw access to a stored page."""

    def __init__(self, name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.name = name
        if name == "redis":
            self.server: RedisServer = request.getfixturevalue("redis_server")
            self.extra: dict[str, Any] = {"redis_url": self.server.url, "redis_timeout_s": 0.5, "redis_retry_s": 0.2}
            self.client = self.server.client()
        else:
            self.extra = {"disk_offload_dir": str(tmp_path / "pages"), "disk_offload_max_gb": 0.01}

    def read(self, store: Any, key: str) -> bytes | None:
        tier = store.tier
        if self.name == "redis":
            value = self.client.get(tier.key(page_key(key)))
            return None if value is None else bytes(value)
        path = tier.path(page_key(key))
        return path.read_bytes() if path.exists() else None

    def write(self, store: Any, key: str, value: bytes) -> None:
        tier = store.tier
        if self.name == "redis":
            self.client.set(tier.key(page_key(key)), value)
        else:
            tier.path(page_key(key)).write_bytes(value)


@pytest.fixture(params=["disk", "redis"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Medium:
    sglang()
    return Medium(request.param, tmp_path, request)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_v1_and_v2_calls_round_trip_bit_exact(medium: Medium, layout: str) -> None:
    s = sglang()
    pool = host_pool(layout)
    store = backend(pool, medium.extra)
    assert type(store).__name__ == "PagedKVStorage" and store.pages.row_bytes == ROW_BYTES
    keys = page_keys(8)
    # v1, zero-copy: host pages 1..3 -> medium -> host pages 10..12
    assert store.batch_set_v1(keys[:3], slots([1, 2, 3])) == [True, True, True]
    for i, page in enumerate([1, 2, 3]):  # what is stored: the header, then the pool's flat data page
        value = medium.read(store, keys[i])
        assert (
            value is not None
            and len(value) == HEADER_SIZE + ROW_BYTES
            and value[HEADER_SIZE:] == page_bytes(pool, page)
        )
        header = decode_header(value)
        assert header is not None and (header.key, header.fingerprint) == (bytes.fromhex(keys[i]), store.fingerprint)
    assert store.batch_exists(keys) == 3 and store.batch_exists(keys[:3]) == 3 and store.batch_exists(keys[3:]) == 0
    assert store.exists(keys[2]) and not store.exists(keys[3])
    assert store.batch_get_v1(keys[:4], slots([10, 11, 12, 13])) == [True, True, True, False]
    assert [page_bytes(pool, p) for p in (10, 11, 12)] == [page_bytes(pool, p) for p in (1, 2, 3)]
    # legacy flat pages, as the controller calls them: get into dummy pages, set from get_data_page
    flats = store.batch_get(keys[:4], [pool.get_dummy_flat_data_page() for _ in range(4)])
    assert flats[3] is None
    assert [f.view(torch.uint8).numpy().tobytes() for f in flats[:3]] == [page_bytes(pool, p) for p in (1, 2, 3)]
    assert store.get(keys[0], pool.get_dummy_flat_data_page()) is not None and store.get(keys[5]) is None
    assert store.batch_set(keys[3:5], [pool.get_data_page(p * PAGE) for p in (4, 5)]) is True
    assert store.set(keys[5], pool.get_data_page(6 * PAGE)) is True
    assert store.batch_get_v1(keys[3:6], slots([14, 15, 16])) == [True, True, True]  # legacy in, v1 out
    assert [page_bytes(pool, p) for p in (14, 15, 16)] == [page_bytes(pool, p) for p in (4, 5, 6)]
    # v2 with the KV pool
    kv = s.storage.PoolName.KV
    transfer = s.storage.PoolTransfer(name=kv, host_indices=slots([7, 8]), keys=keys[6:8])
    assert store.batch_set_v2([transfer]) == {kv: [True, True]}
    hit = store.batch_exists_v2(keys, [s.storage.PoolTransfer(name=kv, keys=keys)])
    assert (hit.kv_hit_pages, hit.extra_pool_hit_pages, hit.restorable_prefix_pages) == (8, {kv: 8}, list(range(1, 9)))
    back = s.storage.PoolTransfer(name=kv, host_indices=slots([17, 18]), keys=keys[6:8])
    assert store.batch_get_v2([back]) == {kv: [True, True]}
    assert [page_bytes(pool, p) for p in (17, 18)] == [page_bytes(pool, p) for p in (7, 8)]
    # sidecar pools are not stored: no prefix is restorable with one, and their reads / writes fail
    mamba = s.storage.PoolName.MAMBA
    side = s.storage.PoolTransfer(name=mamba, host_indices=slots([19]), keys=keys[:1])
    none = store.batch_exists_v2(keys, [side])
    assert (none.kv_hit_pages, none.extra_pool_hit_pages, none.restorable_prefix_pages) == (0, {}, [])
    assert store.batch_get_v2([side, back]) == {mamba: [False], kv: [True, True]}
    assert store.batch_set_v2([side]) == {mamba: [False]}
    stats = store.tier_stats()
    assert (stats["errors"], stats["refused"], stats["skipped_writes"]) == (0, 0, 0)
    store.clear()
    assert store.batch_exists(keys) == 0
    store.close()


def test_keys_carry_the_rank_and_the_layout_fingerprint(redis_server: RedisServer, tmp_path: Path) -> None:
    pool = host_pool("page_first")
    extra = {"redis_url": redis_server.url}
    store = backend(pool, extra, model="meta-llama/Llama-3.1-8B", tp_rank=1, tp_size=2)
    keys = page_keys(2)
    assert store.batch_set_v1(keys, slots([0, 1])) == [True, True]
    names = sorted(k.decode() for k in redis_server.client().keys("*"))
    fp = store.fingerprint.hex()
    assert names == sorted(f"pagedkv:sglang:meta-llama-Llama-3.1-8B_1_2:{fp}:{k}" for k in keys)
    # every other rank, model, layout or signing key is another namespace: the pages are misses there
    others = [
        backend(host_pool("page_first"), extra, model="meta-llama/Llama-3.1-8B", tp_rank=0, tp_size=2),
        backend(host_pool("page_first"), extra, model="meta-llama/Llama-3.1-8B", tp_rank=1, tp_size=4),
        backend(host_pool("page_first"), extra, model="other-model", tp_rank=1, tp_size=2),
        backend(host_pool("page_first_direct"), extra, model="meta-llama/Llama-3.1-8B", tp_rank=1, tp_size=2),
        backend(host_pool("page_first", dtype=torch.float16), extra, model="meta-llama/Llama-3.1-8B", tp_rank=1,
                tp_size=2),
        backend(host_pool("page_first"), {**extra, "tier_hmac_key": "k" * 16}, model="meta-llama/Llama-3.1-8B",
                tp_rank=1, tp_size=2),
    ]  # fmt: skip
    assert [o.batch_exists(keys) for o in others] == [0] * 6
    assert [o.batch_get_v1(keys, slots([5, 6])) for o in others] == [[False, False]] * 6
    assert backend(host_pool("page_first"), extra, model="meta-llama/Llama-3.1-8B", tp_rank=1,
                   tp_size=2).batch_exists(keys) == 2  # fmt: skip


def _second_process(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH")]  # (ROOT: benchmarks)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    worker = Path(__file__).with_name("sglang_storage_worker.py")
    result = subprocess.run([sys.executable, str(worker), json.dumps(spec)], capture_output=True, text=True, env=env,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_another_process_reads_the_pages_bit_identical(medium: Medium, layout: str) -> None:
    pool = host_pool(layout, seed=3)
    extra = {**medium.extra, "tier_hmac_key": "a shared deployment secret"}
    store = backend(pool, extra)
    keys = page_keys(6)
    assert store.batch_set_v1(keys[:4], slots([2, 4, 6, 8])) == [True] * 4
    store.close()
    report = _second_process({"extra": extra, "layout": layout, "read": keys[:5], "write": keys[4:]})
    assert report["exists"] == 4 and report["got"] == [True, True, True, True, False]
    assert [bytes.fromhex(h) for h in report["read_pages"][:4]] == [page_bytes(pool, p) for p in (2, 4, 6, 8)]
    assert report["set"] == [True, True]
    reader = backend(pool, extra)  # and back: this process reads what the other one wrote
    assert reader.batch_exists(keys) == 6
    assert reader.batch_get_v1(keys[4:], slots([30, 31])) == [True, True]
    assert [page_bytes(pool, p).hex() for p in (30, 31)] == report["written_pages"]


def _forge(value: bytes, **_: Any) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 1])  # one payload bit: the checksum / HMAC no longer matches


def _truncate(value: bytes, **_: Any) -> bytes:
    return value[: HEADER_SIZE + ROW_BYTES // 2]


@pytest.mark.parametrize("signed", [False, True], ids=["checksum", "hmac"])
@pytest.mark.parametrize("damage", ["forged", "truncated", "wrong-layout", "wrong-signature", "unsigned"])
def test_bad_pages_are_misses_never_data(medium: Medium, damage: str, signed: bool) -> None:
    if damage == "unsigned" and not signed:
        pytest.skip("an unsigned page is what a checksum-only reader expects")
    secret = {"tier_hmac_key": "the deployment's secret"} if signed else {}
    pool = host_pool("page_first")
    store = backend(pool, {**medium.extra, **secret})
    keys = page_keys(4)
    assert store.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4
    good = medium.read(store, keys[1])
    assert good is not None
    if damage in ("forged", "truncated"):
        bad = (_forge if damage == "forged" else _truncate)(good)
    else:  # a complete, valid page of another writer (its own namespace), planted under this page's name
        own = (
            {"disk_offload_dir": medium.extra["disk_offload_dir"] + "-other"}
            if medium.name == "disk"
            else {"redis_key_prefix": "other:"}
        )
        other_secret = {"tier_hmac_key": "another deployment's key"} if damage == "wrong-signature" else (
            {} if damage == "unsigned" else secret)  # fmt: skip
        other_layout = "page_first_direct" if damage == "wrong-layout" else "page_first"
        other = backend(host_pool(other_layout, seed=9), {**medium.extra, **own, **other_secret})
        assert other.batch_set_v1(keys[1:2], slots([5])) == [True]
        bad = medium.read(other, keys[1])
        assert bad is not None and bad != good
    medium.write(store, keys[1], bad)
    before = page_bytes(pool, 11)
    # a header that cannot be this page (truncated, another layout, signed or not as it should be)
    # stops batch_exists; a bad payload or signature is only seen by reading it
    header_bad = damage in ("truncated", "wrong-layout", "unsigned") or (damage == "wrong-signature" and not signed)
    assert store.batch_exists(keys) == (1 if header_bad else 4)
    if not header_bad:
        assert store.batch_get_v1(keys, slots([10, 11, 12, 13])) == [True, False, False, False]
        assert page_bytes(pool, 10) == page_bytes(pool, 1)
        if medium.name == "redis":  # checked before a byte is copied into the pool
            assert page_bytes(pool, 11) == before
        assert store.batch_exists(keys) == 1  # the refused page is a miss now
    assert medium.read(store, keys[1]) == bad  # and left in place: a reader never deletes a page
    assert store.batch_get_v1(keys[1:2], slots([11])) == [False] and store.get(keys[1]) is None
    assert store.tier_stats()["refused"] == 1  # once for that version of the page, however often it is read
    assert store.batch_set_v1(keys[1:2], slots([2])) == [True]  # written over by the refusing backend, read again
    assert store.batch_get_v1(keys, slots([10, 11, 12, 13])) == [True] * 4
    assert [page_bytes(pool, p) for p in (10, 11, 12, 13)] == [page_bytes(pool, p) for p in (1, 2, 3, 4)]


def test_a_killed_redis_gives_misses_and_skipped_writes_never_an_exception(redis_server: RedisServer) -> None:
    pool = host_pool("page_first_direct")
    store = backend(pool, {"redis_url": redis_server.url, "redis_timeout_s": 0.5, "redis_retry_s": 0.3})
    keys = page_keys(4)
    assert store.batch_set_v1(keys[:2], slots([1, 2])) == [True, True]
    redis_server.stop()  # kill -9
    calls: list[Callable[[], Any]] = [
        lambda: store.batch_exists(keys), lambda: store.batch_get_v1(keys[:2], slots([5, 6])),
        lambda: store.batch_set_v1(keys[2:], slots([3, 4])), lambda: store.get(keys[0]),
        lambda: store.set(keys[3], pool.get_data_page(4 * PAGE)), lambda: store.exists(keys[0]),
        lambda: store.batch_exists_v2(keys).kv_hit_pages, lambda: store.clear(),
    ]  # fmt: skip
    assert [call() for call in calls] == [0, [False, False], [False, False], None, False, False, 0, None]
    stats = store.tier_stats()
    assert stats["errors"] >= 1 and stats["skipped_writes"] == 3 and stats["pages_loaded"] == 0
    redis_server.start()  # back, empty, on the same port: after redis_retry_s the tier is used again
    time.sleep(0.35)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, slots([1, 2, 3, 4])) == [True] * 4
    assert store.batch_get_v1(keys, slots([5, 6, 7, 8])) == [True] * 4
    assert [page_bytes(pool, p) for p in (5, 6, 7, 8)] == [page_bytes(pool, p) for p in (1, 2, 3, 4)]


def test_storage_metrics_are_sglangs(tmp_path: Path) -> None:
    s = sglang()
    pool = host_pool("page_first")
    store = backend(pool, {"disk_offload_dir": str(tmp_path)}, metrics=True)
    keys = page_keys(3)
    assert store.batch_set_v1(keys, slots([1, 2, 3])) == [True] * 3
    assert store.batch_get_v1(keys, slots([4, 5, 6])) == [True] * 3
    metrics = store.get_stats()
    assert isinstance(metrics, s.StorageMetrics)
    assert (metrics.prefetch_pgs, metrics.backup_pgs) == ([3], [3])
    assert len(metrics.prefetch_bandwidth) == len(metrics.backup_bandwidth) == 1 and metrics.prefetch_bandwidth[0] > 0
    assert store.get_stats().prefetch_pgs == []  # drained


HOSTILE: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({}, ValueError, "exactly one medium"),
    ({"disk_offload_dir": "/tmp/x", "redis_url": "redis://h:1"}, ValueError, "got both"),
    ({"disk_offload_dir": "/tmp/x", "dsik_dir": "/tmp/y"}, ValueError, r"unknown key\(s\) \['dsik_dir'\]"),
    ({"redis_url": 6379}, TypeError, r"extra_config\['redis_url'\]=6379 must be a str"),
    ({"redis_url": "http://h:1"}, ValueError, r"extra_config\['redis_url'\]='http://h:1' must start with"),
    ({"redis_url": ""}, ValueError, r"extra_config\['redis_url'\]='' must not be empty"),
    ({"redis_cluster_nodes": "h:1"}, TypeError, r"extra_config\['redis_cluster_nodes'\]='h:1' must be a non-empty"),
    ({"redis_cluster_nodes": ["h:1", "h"]}, ValueError, r"redis_cluster_nodes.*'h' must be 'host:port'"),
    ({"redis_cluster_nodes": ["h:70000"]}, ValueError, r"port in 1..65535"),
    ({"redis_url": "redis://h:1", "redis_cluster_nodes": ["h:2"]}, ValueError, "redis_cluster_nodes.*redis\\+cluster"),
    ({"redis_url": "redis://h:1", "redis_timeout_s": 0}, ValueError, r"\['redis_timeout_s'\]=0 must be > 0"),
    ({"redis_url": "redis://h:1", "redis_timeout_s": "1"}, TypeError, r"\['redis_timeout_s'\]='1' must be a number"),
    ({"redis_url": "redis://h:1", "redis_retry_s": -1}, ValueError, r"\['redis_retry_s'\]=-1 must be > 0"),
    ({"redis_url": "redis://h:1", "redis_ttl_s": 0}, ValueError, r"\['redis_ttl_s'\]=0 must be in \[1, "),
    ({"redis_url": "redis://h:1", "redis_ttl_s": 1.5}, TypeError, r"\['redis_ttl_s'\]=1.5 must be an int"),
    ({"redis_url": "redis://h:1", "io_threads": 0}, ValueError, r"\['io_threads'\]=0 must be in \[1, 64\]"),
    ({"redis_url": "redis://h:1", "io_threads": True}, TypeError, r"\['io_threads'\]=True must be an int"),
    (
        {"redis_url": "redis://h:1", "disk_offload_max_gb": 1},
        ValueError,
        r"\['disk_offload_max_gb'\]=1 applies to a directory",
    ),
    (
        {"disk_offload_dir": "/tmp/x", "redis_key_prefix": "p:"},
        ValueError,
        r"\['redis_key_prefix'\]='p:' applies to a Redis",
    ),
    ({"redis_url": "redis://h:1", "redis_key_prefix": "a*"}, ValueError, r"\['redis_key_prefix'\]='a\*'... must be"),
    (
        {"disk_offload_dir": "/tmp/x", "disk_offload_max_gb": float("inf")},
        ValueError,
        r"\['disk_offload_max_gb'\]=inf must be > 0",
    ),
    ({"disk_offload_dir": "/tmp/x", "disk_offload_max_gb": 0}, ValueError, r"\['disk_offload_max_gb'\]=0 must be > 0"),
    (
        {"disk_offload_dir": "/tmp/x", "tier_hmac_key": "short"},
        ValueError,
        r"\['tier_hmac_key'\] has 5 bytes; it needs at least 16",
    ),
    ({"disk_offload_dir": "/tmp/x", "tier_hmac_key": 12}, TypeError, r"\['tier_hmac_key'\]='<redacted>' must be a str"),
    ({"disk_offload_dir": "/tmp/x", "disk_dir": "/tmp/y"}, ValueError, r"unknown key\(s\) \['disk_dir'\]"),
    (
        {"disk_offload_dir": "/tmp/x", "tier_hmac_key_file": "/nonexistent/key"},
        ValueError,
        r"\['tier_hmac_key_file'\]=.* cannot be read",
    ),
    (
        {"disk_offload_dir": "/tmp/x", "tier_hmac_key": "k" * 16, "tier_hmac_key_file": "/k"},
        ValueError,
        "both 'tier_hmac_key' and",
    ),
    ({"redis_url": "rediss://h:1/0", "redis_password": 5}, TypeError, r"\['redis_password'\]=5 must be a str"),
]


@pytest.mark.parametrize("extra,error,message", HOSTILE, ids=[str(sorted(h[0]))[:60] for h in HOSTILE])
def test_hostile_config_fails_at_startup_naming_the_key(extra: dict[str, Any], error: type[Exception],
                                                        message: str) -> None:  # fmt: skip
    s = sglang()
    cfg = storage_config(extra)
    with pytest.raises(error, match=message):
        s.Factory.create_backend("dynamic", cfg, None)


def test_a_short_key_file_and_an_unserved_pool_are_refused(tmp_path: Path) -> None:
    s = sglang()
    key_file = tmp_path / "key"
    key_file.write_text("fifteen bytes\n")
    cfg = storage_config({"disk_offload_dir": str(tmp_path), "tier_hmac_key_file": str(key_file)})
    with pytest.raises(ValueError, match=r"\['tier_hmac_key_file'\] has 13 bytes; it needs at least 16"):
        s.Factory.create_backend("dynamic", cfg, None)
    key_file.write_text("a key of twenty-two b\n")
    good = storage_config({"disk_offload_dir": str(tmp_path), "tier_hmac_key_file": str(key_file)})
    store = s.Factory.create_backend("dynamic", good, None)
    assert store.settings.tier_hmac_key == b"a key of twenty-two b"
    assert store.batch_exists(page_keys(1)) == 0 and store.batch_get_v1(page_keys(1), slots([0])) == [False]
    with pytest.raises(TypeError, match="not an MHA host pool"):
        store.register_mem_pool_host(object())
