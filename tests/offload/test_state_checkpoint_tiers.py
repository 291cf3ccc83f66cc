"""State checkpoints of a model with recurrent state in the tiers below the device, against hostile files, a
real redis-server (shared, then killed) and KV event listeners. See `manager/test_state_tiers.py` for the
model (`RandomModel`: random bytes at every computed position and over the live state row) and the warm
restarts these build on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer

from helpers import ctx
from manager.state_tiers_support import (
    STATE,
    Held,
    RandomModel,
    checkpoint_file,
    key_of,
    layout,
    loaded,
    manager,
    page_hashes,
    run,
    state_dir,
    tokens,
)
from pagedkv.core.events import BlockRemoved, BlockStored, KVEventBatch
from pagedkv.offload.format import HEADER_SIZE, decode_header, key_bytes
from pagedkv.params.connector import KVConnectorConfig

KEY = b"deployment-secret-0123456789"
OTHER_STATE = ((3, 6), (2, 4, 8))  # as many bytes per row as STATE, another layout


# ----------------------------------------------------------------- hostile files
def first_process(directory: Path, ps: int, n: int, **config: Any) -> tuple[list[int], Path]:
    """Manager A serves `n` tokens and exits; returns its tokens and its release checkpoint's file."""
    a = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(directory), **config)))
    c = run(a, RandomModel(a, n), "a", tokens(n, n))
    a.release("a")
    files = state_dir(a, directory)
    a.close()
    toks = c.tokens.all.tolist()
    return toks, checkpoint_file(a, files, toks, len(toks) - 1)


def other_layout_file(directory: Path, ps: int, n: int) -> bytes:
    """The same checkpoint (same tokens, same key) written by a model whose state tensors have other shapes."""
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(directory)), states=(OTHER_STATE,)))
    c = run(b, RandomModel(b, n), "a", tokens(n, n))
    b.release("a")
    files = state_dir(b, directory)
    b.close()
    return checkpoint_file(b, files, c.tokens.all.tolist(), len(c.tokens.all) - 1).read_bytes()


@pytest.mark.parametrize(
    ("fault", "ps", "n"),
    [("flip", 16, 11), ("flip", 4, 23), ("truncate", 16, 11), ("other layout", 16, 11), ("wrong key", 16, 11)],
)
def test_a_damaged_or_foreign_checkpoint_is_refused_and_recomputed(tmp_path: Path, fault: str, ps: int, n: int) -> None:
    """The deepest checkpoint file B reads (A's release, at n + 2) is refused (counted, left in place), and B falls back
    to the next one the tiers hold, A's prompt end (n), and serves on. With pages of 16 neither needs an
    attention page; with pages of 4 the 6 pages before 25 load first, and only the 5 before 23 are committed
    as hits (the 6th holds A's bytes but no hash: B computes it again)."""
    signed = {"tier_hmac_key": KEY} if fault == "wrong key" else {}
    toks, path = first_process(tmp_path / "tier", ps, n, **signed)
    data = damaged = path.read_bytes()
    if fault == "flip":
        path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x01]) + data[-6:])  # one payload bit
    elif fault == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif fault == "other layout":
        foreign = other_layout_file(tmp_path / "other", ps, n)
        assert len(foreign) == len(data) and decode_header(foreign).key == decode_header(data).key  # type: ignore[union-attr]
        assert decode_header(foreign).fingerprint != decode_header(data).fingerprint  # type: ignore[union-attr]
        path.write_bytes(foreign)
    damaged = path.read_bytes()
    reader = {"tier_hmac_key": b"another-secret-0123456789"} if fault == "wrong key" else {}
    b = manager(layout(ps, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path / "tier"), **reader)))
    c = ctx("b", [*toks, 9, 10, 11])
    b.claim("b")
    b.alloc(c)  # (runtime checks: integrity holds after every call)
    fallback = fault != "wrong key"  # (a reader with another key does not even look at what A signed)
    assert c.cached_prefix_length == (n if fallback else 0)  # the prompt-end checkpoint, the deepest that loads
    stats = b.tier_stats()
    pages, hit = (len(toks) - 1) // ps, n // ps if fallback else 0
    assert (stats["disk_states"]["refused"], stats["disk_states"]["pages_loaded"]) == ((1, 1) if fallback else (0, 0))
    assert (stats["disk"]["refused"], stats["disk"]["pages_loaded"]) == (0, pages)
    pool = b._managers[0].pool
    hashes = page_hashes(b, toks, pages)
    assert all(pool.cached_page(h, 0) is not None for h in hashes[:hit])
    assert all(pool.cached_page(h, 0) is None for h in hashes[hit:])
    assert path.read_bytes() == (data if fault == "wrong key" else damaged)  # a reader deletes or changes nothing
    RandomModel(b, 1).forward([c])
    c.update(1)
    b.step([[c]])
    b.release("b")
    b.check_integrity()
    b.close()


def test_a_deleted_checkpoint_file_is_a_miss_not_an_error(tmp_path: Path) -> None:
    """A's release checkpoint file (13) is deleted from the directory: the deepest one left (its prompt end,
    11) serves; nothing is refused or counted as an error."""
    toks, path = first_process(tmp_path, 16, 11)
    path.unlink()
    b = manager(layout(16, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    c = ctx("b", [*toks, 9])
    b.claim("b")
    b.alloc(c)
    assert c.cached_prefix_length == 11  # the prompt end is the deepest one left
    stats = b.tier_stats()["disk_states"]
    assert (stats["refused"], stats["errors"], stats["pages_loaded"]) == (0, 0, 1)
    b.release("b")
    b.close()


# ----------------------------------------------------------------- Redis
@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.running(tmp_path) as server:
        yield server


def test_managers_share_checkpoints_through_redis_and_miss_when_it_dies(redis_server: RedisServer) -> None:
    """A writes its pages and checkpoints to Redis (no host rows); B resumes at A's release checkpoint with
    A's bytes. With the server killed, C misses (0), counts one error per connector and skips its writes
    (Redis is skipped for redis_retry_s after an error); nothing raises."""
    cfg = KVConnectorConfig(redis_url=redis_server.url, redis_key_prefix="states:", redis_retry_s=60,
                            redis_timeout_s=0.5)  # fmt: skip
    a = manager(layout(4, "redis", cfg), host_pages=0)
    assert a.tier_stats().keys() == {"redis", "redis_states"}
    c = run(a, RandomModel(a, 2), "a", tokens(23, 1))
    held = Held(a, "a", 25)
    a.release("a")
    a.sync_tiers()
    assert (a.tier_stats()["redis"]["pages_stored"], a.tier_stats()["redis_states"]["pages_stored"]) == (6, 2)
    a.close()
    assert len(redis_server.client().keys("states:*")) == 8
    toks = [*c.tokens.all.tolist(), 5, 6]

    b = manager(layout(4, "redis", cfg), host_pages=0)
    c2 = ctx("b", toks)
    b.claim("b")
    b.alloc(c2)
    assert c2.cached_prefix_length == 25 and loaded(b) == {"redis": 6, "redis_states": 1}
    b.runtime_inputs([[c2]])
    assert Held(b, "b", 25) == held
    b.release("b")
    b.close()

    redis_server.stop()
    d = manager(layout(4, "redis", cfg), host_pages=0)
    c3 = ctx("c", toks)
    d.claim("c")
    d.alloc(c3)
    assert c3.cached_prefix_length == 0 and loaded(d) == {"redis": 0, "redis_states": 0}
    RandomModel(d, 3).forward([c3])
    c3.update(1)
    d.step([[c3]])
    d.release("c")
    d.sync_tiers()
    stats = d.tier_stats()
    assert (stats["redis"]["errors"], stats["redis"]["skipped_writes"]) == (1, 7)  # 28 tokens: 7 pages
    assert (stats["redis_states"]["errors"], stats["redis_states"]["skipped_writes"]) == (1, 1)  # its prompt end
    d.check_integrity()
    d.close()


# ----------------------------------------------------------------- KV events
def events_of(batches: list[KVEventBatch], medium: str) -> list[Any]:
    return [e for batch in batches for e in batch.events if getattr(e, "medium", None) == medium]


def test_host_rows_of_checkpoints_are_reported_once_per_state_group() -> None:
    """Two state caches (groups 1 and 2) beside one attention cache; one host row for checkpoint images.
    Each prompt's checkpoint (its end, 6, 7 and 9 tokens) is copied to that row: `BlockStored` medium "CPU",
    kind "mamba", once per state group, parented on the page before its tail; the next one evicts it first:
    `BlockRemoved` per state group."""
    ps = 4
    m = manager(layout(ps, "local", states=(STATE, ((4, 4),))), host_pages=8)
    states = m._managers[0].states
    assert states is not None and states.groups == (1, 2)
    assert m.tiers.state_connectors[0].num_host_blocks == 1
    batches: list[KVEventBatch] = []
    m.add_kv_event_listener(batches.append)
    model = RandomModel(m, 4)
    expected: list[Any] = []
    previous = None
    for i, n in enumerate((6, 7, 9)):
        prompt = tokens(n, 50 + i)
        m.release(run(m, model, i, prompt, new=1).request_id)  # prompt end = release position: one checkpoint
        m.sync_tiers()
        parent = page_hashes(m, prompt, n // ps)[-1]
        key = key_of(m, prompt, n)
        if previous is not None:
            expected += [BlockRemoved([previous], "CPU", g) for g in (1, 2)]
        expected += [BlockStored([key], key_bytes(parent), [], ps, "CPU", g, "mamba") for g in (1, 2)]
        previous = key
    m.step([[]])  # (events go out with a step)
    assert [e for e in events_of(batches, "CPU") if getattr(e, "group_idx", 0) in (1, 2)] == expected
    m.close()


def test_host_rows_of_pages_are_reported_under_their_prefix_hash_and_group() -> None:
    """Two attention groups: a page of group g offloaded to host rows is the same block (hash, group) that
    its device `BlockStored` named; a KV event consumer matches them."""
    m = manager(layout(4, "local", attention=((2, 8), (1, 4))), host_pages=16)
    batches: list[KVEventBatch] = []
    m.add_kv_event_listener(batches.append)
    prompt = tokens(9, 3)
    m.release(run(m, RandomModel(m, 1), "a", prompt, new=1).request_id)
    m.sync_tiers()
    m.step([[]])
    device = {(h, e.group_idx) for e in events_of(batches, "GPU") if e.kv_cache_spec_kind != "mamba"
              for h in e.block_hashes}  # fmt: skip
    host = {(h, e.group_idx) for e in events_of(batches, "CPU") if e.kv_cache_spec_kind != "mamba"
            for h in e.block_hashes}  # fmt: skip
    assert device == {(h, g) for h in page_hashes(m, prompt, 2) for g in (0, 1)}
    assert host == device
    m.close()


def test_refused_checkpoint_leaves_the_state_row_untouched_for_the_next_admission(tmp_path: Path) -> None:
    """A refused image stages nothing into the request's live row (B resumes from A's prompt end, 11, the next
    checkpoint held): what B computes there is its own, and the checkpoint B's release keeps (at 18: its 16
    tokens and 2 of its 3 generated) serves a next request of B's from the device, bit for bit (state row,
    page 0, the tail's 2 slots)."""
    toks, path = first_process(tmp_path, 16, 11)
    path.write_bytes(path.read_bytes()[:HEADER_SIZE])  # a header and no payload
    b = manager(layout(16, "tiered", KVConnectorConfig(disk_offload_dir=str(tmp_path))))
    c = run(b, RandomModel(b, 9), "b", [*toks, 9, 10])
    assert c.cached_prefix_length == 11 and b.tier_stats()["disk_states"]["refused"] == 1
    held = Held(b, "b", 18)
    b.release("b")
    d = ctx("d", [*c.tokens.all.tolist(), 4])
    b.claim("d")
    before = loaded(b)["disk_states"]
    b.alloc(d)
    assert d.cached_prefix_length == 18 and loaded(b)["disk_states"] == before  # from the device
    b.runtime_inputs([[d]])
    assert Held(b, "d", 18) == held
    b.release("d")
    b.close()
