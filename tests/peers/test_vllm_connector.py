"""`PagedKVConnector` driven by vLLM 0.33's real `Scheduler` on CPU (run in `.venv-peers`, `make test-peers`).

The connector is loaded by vLLM's own `KVConnectorFactory` from ``kv_connector_module_path``; the KV cache
is allocated by vLLM's own `allocate_kv_cache`; a stand-in forward writes each computed token's K/V
(`vllm_engine`). Engine A computes a prompt and saves its blocks; engine B (fresh KV cache, in this
process or another one) loads them by vLLM's block hashes, sync or async, bit for bit, through a
directory and through a real redis-server. Missing, forged, truncated and wrong-layout pages, and a
killed Redis, become misses or load errors that vLLM recomputes, never an exception in the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_engine import BLOCK, Engine, expected_kv, model_dir, vllm_or_skip

from pagedkv.offload.format import HEADER_SIZE, encode_header

PROMPT = list(range(100, 150))  # 50 tokens: 3 full blocks of 16 are shareable (the last token is computed)
KEY = "a-secret-of-at-least-16-bytes"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    vllm_or_skip()
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    from redis_server import RedisServer

    with RedisServer.running(tmp_path) as server:
        yield server


def _extra(tier: str, tmp_path: Path, redis: Any, **more: Any) -> dict[str, Any]:
    if tier == "disk":
        return {"disk_offload_dir": str(tmp_path / "tier"), **more}
    return {"redis_url": redis.url, "redis_key_prefix": "t:", "redis_timeout_s": 0.3, "redis_retry_s": 0.2, **more}


def _fill(model: str, extra: dict[str, Any], tokens: list[int] = PROMPT) -> Engine:
    """Engine A: computes `tokens` and saves its full blocks; returns it (closed)."""
    a = Engine.build(model, extra)
    a.add("a0", tokens)
    a.run()
    assert a.log[0]["saves"] == len(tokens) // BLOCK and a.log[0]["loads"] == []
    assert torch.equal(a.kv_of("a0", tokens), expected_kv(tokens))
    a.close()
    return a


def _keys(engine: Engine, tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of `tokens` (the page keys)."""
    params = engine.v.sampling_params.SamplingParams(max_tokens=1)
    request = engine.v.request.Request("probe", tokens, params, None, block_hasher=engine.hasher)
    return list(request.block_hashes)


def test_vllms_factory_loads_the_connector_by_module_path(model: str, tmp_path: Path) -> None:
    v = vllm_or_skip()
    engine = Engine.build(model, {"disk_offload_dir": str(tmp_path)})
    cls = type(engine.scheduler.connector)
    assert cls is type(engine.worker) and cls.__name__ == "PagedKVConnector"
    assert issubclass(cls, v.base.KVConnectorBase_V1)
    assert cls.__module__ == "pagedkv.integrations.vllm.connector"
    assert engine.worker.mover.stacked is not None  # vLLM's buffer: one strided view of all layers
    assert engine.scheduler.connector.get_num_new_matched_tokens(_probe(engine, PROMPT), 0) == (0, False)
    engine.close()


def _probe(engine: Engine, tokens: list[int]) -> Any:
    params = engine.v.sampling_params.SamplingParams(max_tokens=1)
    return engine.v.request.Request("probe", tokens, params, None, block_hasher=engine.hasher)


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_second_engine_loads_the_first_ones_blocks(model: str, tmp_path: Path, redis_server: Any, tier: str,
                                                   load_async: bool) -> None:  # fmt: skip
    extra = _extra(tier, tmp_path, redis_server, load_async=load_async)
    _fill(model, extra)
    b = Engine.build(model, extra)
    assert b.scheduler.connector.get_num_new_matched_tokens(_probe(b, PROMPT), 0) == (48, load_async)
    assert b.scheduler.connector.get_num_new_matched_tokens(_probe(b, PROMPT), 16) == (32, load_async)
    assert b.scheduler.connector.get_num_new_matched_tokens(_probe(b, PROMPT[:48]), 0) == (32, load_async)
    b.add("b0", PROMPT)
    log = b.run()
    assert log[0]["loads"] == [("b0", 3, load_async)]
    if load_async:  # nothing is scheduled until the worker reports the load in finished_recving
        waiting = next(i for i, s in enumerate(log) if s["recving"])
        assert log[waiting]["recving"] == ["b0"] and all(s["scheduled"] == {} for s in log[: waiting + 1])
        first = log[waiting + 1]
    else:
        first = log[0]
        assert first["sync_loads"]
    assert (first["scheduled"], first["computed"], first["invalid"]) == ({"b0": 2}, {"b0": 48}, [])
    assert torch.equal(b.kv_of("b0", PROMPT), expected_kv(PROMPT))  # loaded blocks and computed ones alike
    stats = b.worker.tiers.stats[tier].snapshot()
    assert (stats["pages_loaded"], stats["refused"], stats["errors"]) == (3, 0, 0)
    b.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_engine_in_another_process_of_another_layout_loads_bit_identical(model: str, tmp_path: Path,
                                                                         redis_server: Any, tier: str) -> None:  # fmt: skip
    extra = _extra(tier, tmp_path, redis_server)
    _fill(model, extra)  # layout LBHNC (what vLLM's CPU backend uses)
    other = PROMPT[:40] + [999] * 10  # shares 2 blocks with PROMPT, then diverges
    spec = {"model": model, "extra": extra, "layout": "LBNHC", "prompts": [PROMPT, other],
            "out": str(tmp_path / "child.pt")}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    root = Path(__file__).parents[2]  # src (pagedkv), tests (helpers), the root (benchmarks: the peers' import shim)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests"), str(root)])}
    child = subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_engine.py"), str(tmp_path / "spec.json")],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = torch.load(tmp_path / "child.pt")
    assert torch.equal(result["kv"]["c0"], expected_kv(PROMPT))
    assert torch.equal(result["kv"]["c1"], expected_kv(other))
    first = result["log"][0]
    assert first["loads"] == [("c0", 3, False)]  # c1 then hits c0's loaded blocks in vLLM's device cache
    assert first["computed"] == {"c0": 48, "c1": 32} and first["scheduled"] == {"c0": 2, "c1": 18}
    assert first["saves"] == 1  # c1's own third block
    assert result["stats"][tier]["pages_loaded"] == 3 and result["stats"][tier]["refused"] == 0


def _page_path(tmp_path: Path, key: bytes) -> Path:
    [path] = (tmp_path / "tier").glob(f"*/{key[0]:02x}/{key.hex()}.page")
    return path


def _redis_name(engine: Engine, key: bytes) -> str:
    [tier] = engine.worker.tiers.tiers
    return str(tier.key(key))


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("damage", ["forged", "truncated", "flipped", "other-layout", "missing"])
def test_bad_pages_are_load_errors_and_vllm_recomputes(model: str, tmp_path: Path, redis_server: Any, tier: str,
                                                       damage: str) -> None:  # fmt: skip
    extra = _extra(tier, tmp_path, redis_server, tier_hmac_key=KEY)
    a = _fill(model, extra)
    key = _keys(a, PROMPT)[1]  # the second block's page
    b = Engine.build(model, extra)
    [store] = b.worker.tiers.tiers
    if tier == "disk":
        raw = _page_path(tmp_path, key).read_bytes()
    else:
        raw = redis_server.client().get(_redis_name(b, key))
    original = raw
    header, payload = raw[:HEADER_SIZE], raw[HEADER_SIZE:]
    if damage == "forged":  # a valid page of this layout and key, signed with another key
        payload = bytes(len(payload))
        raw = encode_header(key, payload, store.fingerprint, "sha256", b"not-the-deployment-key") + payload
    elif damage == "truncated":
        raw = raw[: HEADER_SIZE + len(payload) // 2]
    elif damage == "flipped":
        raw = header + bytes([payload[0] ^ 1]) + payload[1:]
    elif damage == "other-layout":  # a genuine, signed page of another model under the same key
        raw = encode_header(key, payload, bytes(16), "sha256", KEY.encode()) + payload
    if tier == "disk":
        path = _page_path(tmp_path, key)
        path.unlink() if damage == "missing" else path.write_bytes(raw)
    elif damage == "missing":
        redis_server.client().delete(_redis_name(b, key))
    else:
        redis_server.client().set(_redis_name(b, key), raw)
    b.add("b0", PROMPT)
    log = b.run()
    if damage == "missing":  # the lookup sees the gap: only block 0 is loaded
        assert log[0]["loads"] == [("b0", 1, False)] and log[0]["invalid"] == []
        assert log[0]["computed"] == {"b0": 16}
    else:  # the lookup counts 3 (nothing is read): block 1 is refused, blocks 1 and 2 are load errors
        blocks = b.blocks["b0"]
        assert log[0]["loads"] == [("b0", 3, False)] and log[0]["invalid"] == blocks[1:3]
        assert log[1]["computed"] == {"b0": 16} and log[1]["scheduled"] == {"b0": 34}  # vLLM recomputes
        assert store.stats.refused == 1 and log[1]["saves"] == 2  # the refused page is left, then written over:
    b.worker.wait_for_writes()
    if tier == "disk":  # the recomputed blocks are stored again, the same bytes as engine A's
        assert _page_path(tmp_path, key).read_bytes() == original
    else:
        assert redis_server.client().get(_redis_name(b, key)) == original
    assert torch.equal(b.kv_of("b0", PROMPT), expected_kv(PROMPT))
    b.close()


def test_a_killed_redis_is_a_miss_never_an_error_in_the_step(model: str, tmp_path: Path, redis_server: Any) -> None:
    extra = _extra("redis", tmp_path, redis_server)
    _fill(model, extra)
    # dies between the scheduler's lookup and the worker's load: the load fails, vLLM recomputes
    b = Engine.build(model, extra)
    b.add("b0", PROMPT)
    b.step(before_worker=redis_server.stop)
    assert b.log[0]["loads"] == [("b0", 3, False)] and b.log[0]["invalid"] == b.blocks["b0"][:3]
    b.run()
    assert b.log[1]["computed"] == {"b0": 0} and b.log[1]["scheduled"] == {"b0": 50}
    assert torch.equal(b.kv_of("b0", PROMPT), expected_kv(PROMPT))
    assert b.worker.tiers.stats["redis"].errors >= 1
    # dead from the start: lookups miss, saves are skipped, every step runs
    c = Engine.build(model, extra)
    c.add("c0", PROMPT)
    c.run()
    assert c.log[0]["loads"] == [] and c.log[0]["scheduled"] == {"c0": 50} and c.log[0]["saves"] == 3
    assert torch.equal(c.kv_of("c0", PROMPT), expected_kv(PROMPT))
    assert c.worker.tiers.stats["redis"].skipped_writes == 3
    b.close()
    c.close()


@pytest.mark.parametrize("change", ["model_id", "kv_heads", "unsigned"])
def test_a_page_of_another_layout_is_a_miss(model: str, tmp_path: Path, change: str) -> None:
    extra = {"disk_offload_dir": str(tmp_path / "tier"), "tier_hmac_key": KEY}
    _fill(model, extra)
    other = dict(extra)
    heads = 2
    if change == "model_id":
        other["model_id"] = "another-model"
    elif change == "kv_heads":
        heads = 4
    else:
        del other["tier_hmac_key"]
    b = Engine.build(model, other, kv_heads=heads)
    b.add("b0", PROMPT)
    b.run()
    assert b.log[0]["loads"] == [] and b.log[0]["scheduled"] == {"b0": 50}
    b.close()


def test_consumer_only_loads_and_producer_only_saves(model: str, tmp_path: Path) -> None:
    extra = {"disk_offload_dir": str(tmp_path / "tier")}
    consumer = Engine.build(model, extra, role="kv_consumer")
    consumer.add("c0", PROMPT)
    consumer.run()
    assert consumer.log[0]["saves"] == 0 and not any((tmp_path / "tier").rglob("*.page"))
    consumer.close()
    producer = Engine.build(model, extra, role="kv_producer")
    producer.add("p0", PROMPT)
    producer.add("p1", PROMPT)  # the same prompt: the producer does not load, it computes
    producer.run()
    assert producer.log[0]["saves"] >= 3 and all(s["loads"] == [] for s in producer.log)
    assert len(list((tmp_path / "tier").rglob("*.page"))) == 3
    producer.close()


@pytest.mark.parametrize(
    "extra,error,words",
    [
        ({}, ValueError, "needs a tier"),
        ({"disk_offload_dir": "/tmp/x", "bogus": 1}, ValueError, "unknown key(s) ['bogus']"),
        ({"redis_url": "http://h:1"}, ValueError, "kv_connector_extra_config['redis_url']='http://h:1' must start"),
        ({"disk_offload_dir": 5}, TypeError, "kv_connector_extra_config['disk_offload_dir']=5 must be a str"),
        ({"disk_offload_dir": "/tmp/x", "io_threads": 0}, ValueError, "['io_threads']=0 must be in [1, 64]"),
        ({"disk_offload_dir": "/tmp/x", "load_async": "yes"}, TypeError, "['load_async']='yes' must be true or false"),
        ({"disk_offload_dir": "/tmp/x", "tier_hmac_key": "short"}, ValueError, "has 5 bytes; it needs at least 16"),
    ],
)  # fmt: skip
def test_hostile_extra_config_fails_at_construction_naming_the_key(model: str, extra: dict[str, Any],
                                                                   error: type[Exception], words: str) -> None:  # fmt: skip
    with pytest.raises(error) as info:
        Engine.build(model, extra)
    assert words in str(info.value)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"])
def test_block_rows_are_vllms_logical_blocks_in_every_layout(model: str, tmp_path: Path, layout: str) -> None:
    engine = Engine.build(model, {"disk_offload_dir": str(tmp_path)}, layout=layout, num_blocks=9)
    mover = engine.worker.mover
    views = [engine.caches[name] for name in engine.worker.layout.layer_names]  # each [B, H, N, C] bf16
    gen = torch.Generator().manual_seed(0)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
    rows = torch.empty((3, mover.row_bytes), dtype=torch.uint8)
    mover.gather([5, 1, 7], rows)
    for i, block in enumerate([5, 1, 7]):
        expected = torch.cat([v[block].contiguous().view(torch.uint8).flatten() for v in views])  # [L, H, N, C]
        assert torch.equal(rows[i], expected)
    before = [v.clone() for v in views]
    mover.scatter(rows, [2, 3, 8])
    for v, old in zip(views, before, strict=True):
        assert torch.equal(v[[2, 3, 8]], old[[5, 1, 7]])
        assert torch.equal(v[[0, 1, 4, 5, 6, 7]], old[[0, 1, 4, 5, 6, 7]])  # nothing else written
    engine.close()


def test_redis_cluster_by_its_startup_nodes(model: str, tmp_path: Path) -> None:
    from redis_cluster import RedisCluster
    from redis_server import free_port

    with RedisCluster.running(tmp_path) as cluster:
        dead = f"127.0.0.1:{free_port()}"  # the first node named is down: the client tries the next ones
        extra = {"redis_cluster_nodes": [dead, *(f"127.0.0.1:{p}" for p in cluster.ports)], "redis_timeout_s": 0.5}
        _fill(model, extra)
        b = Engine.build(model, extra)
        b.add("b0", PROMPT)
        b.run()
        assert b.log[0]["loads"] == [("b0", 3, False)] and b.log[0]["computed"] == {"b0": 48}
        assert torch.equal(b.kv_of("b0", PROMPT), expected_kv(PROMPT))
        assert sum(len(c.keys("pagedkv:*")) for c in cluster.clients()) == 3  # spread over the primaries
        b.close()
