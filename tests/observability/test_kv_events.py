"""KV events over ZMQ: a subscriber receives a scripted run's batches in order, with no gaps, and decodes
them with msgspec Structs written like vLLM's (`vllm/distributed/kv_events.py`), independently of the encoder."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from helpers import ctx, make_params, serve  # noqa: E402
from pagedkv.core import events as ev  # noqa: E402
from pagedkv.manager.paged import PagedKVCacheManager  # noqa: E402
from pagedkv.observability import (  # noqa: E402
    END_SEQ,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    external_block_hash,
    offset_endpoint_port,
)
from pagedkv.testing import PrefixStampModel  # noqa: E402

MASK64 = (1 << 64) - 1
TIMEOUT_MS = 5000


# ----------------------------------------------------------------- vLLM's wire types, as vLLM defines them
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def converted(event: ev.KVEvent, int_hashes: bool) -> ev.KVEvent:
    """The event with its hashes as vLLM sends them (`maybe_convert_block_hash`, written out)."""

    def conv(h: Any) -> Any:
        if not int_hashes or h is None:
            return h
        return (h if isinstance(h, int) else int.from_bytes(h, byteorder="big")) & MASK64

    if isinstance(event, ev.BlockStored):
        return replace(event, block_hashes=[conv(h) for h in event.block_hashes],
                       parent_block_hash=conv(event.parent_block_hash))  # fmt: skip
    if isinstance(event, ev.BlockRemoved):
        return replace(event, block_hashes=[conv(h) for h in event.block_hashes])
    return event


def as_vllm(event: ev.KVEvent, int_hashes: bool) -> KVCacheEvent:
    """The vLLM Struct vLLM would have sent for a pagedkv event."""
    e = converted(event, int_hashes)
    if isinstance(e, ev.BlockStored):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None, e.medium, None,
                           group_idx=e.group_idx)  # fmt: skip
    if isinstance(e, ev.BlockRemoved):
        return BlockRemoved(e.block_hashes, e.medium, group_idx=e.group_idx)
    return AllBlocksCleared()


# ----------------------------------------------------------------- the scripted run
LOCAL = dict(enable_prefix_caching=True, kv_connector="local", host_kvcache_swap_space_gb=1)
PROMPT = list(range(1, 14))
EXPECTED_SHAPE = [  # per batch: (event, medium, pages); the device pool has 6 pages, the host 16
    [("BlockStored", "GPU", 3)],  # a: prompt pages 0-2
    [("BlockStored", "CPU", 3)],  # ... offloaded
    [("BlockStored", "GPU", 1)],  # a: page 3 (13, 100, 101, 102)
    [("BlockStored", "CPU", 1), ("BlockStored", "GPU", 1)],  # b: shares pages 0-1, its page 2 is new
    [("BlockStored", "CPU", 1)],
    [*[("BlockRemoved", "GPU", 1)] * 4, ("BlockStored", "GPU", 5)],  # the evictor takes the whole pool
    [("BlockRemoved", "GPU", 1), ("BlockStored", "CPU", 5)],
    [*[("BlockRemoved", "GPU", 1)] * 3, ("BlockStored", "GPU", 3)],  # c: pages 0-2 come back from host
    [("AllBlocksCleared", None, 0)],  # reset_prefix_cache
]


def scripted_run(mgr: PagedKVCacheManager) -> None:
    """Four requests sharing prefixes through a 6-page pool over a host tier, then a reset."""
    model = PrefixStampModel(mgr)
    serve(mgr, model, ctx("a", PROMPT), 4)
    serve(mgr, model, ctx("b", PROMPT[:8] + [77, 78, 79, 80, 81]), 2)
    serve(mgr, model, ctx("evictor", range(50, 70)), 2)
    serve(mgr, model, ctx("c", PROMPT + [99]), 2)
    mgr.reset_prefix_cache()


def first_page_hash(algo: str, int_hashes: bool, seed: bytes) -> Any:
    """The wire hash of page (1, 2, 3, 4), whose digest is SHA256(SHA256(int32_le(page)) || seed)."""
    digest = hashlib.sha256(hashlib.sha256(struct.pack("<4i", 1, 2, 3, 4)).digest() + seed).digest()
    if algo == "sha256":  # the key is the digest
        return int.from_bytes(digest[24:], "big") if int_hashes else digest
    # sha256_64: the key is the first 8 digest bytes as a signed int
    return int.from_bytes(digest[:8], "big", signed=not int_hashes)


def receive(sock: Any) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "no message within 5 s"
    return sock.recv_multipart()


@pytest.mark.parametrize("algo,int_hashes", [("sha256", True), ("sha256_64", True), ("sha256", False)])
def test_subscriber_receives_a_scripted_run_in_order_without_gaps(algo: str, int_hashes: bool) -> None:
    zctx = zmq.Context.instance()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv",
                            int_hashes=int_hashes)  # fmt: skip
    sub = zctx.socket(zmq.SUB)
    dealer = zctx.socket(zmq.DEALER)
    mgr = PagedKVCacheManager(make_params(**LOCAL, n_kv_heads=2, head_dim=2, num_layers=2, kv_hash_algo=algo, commit_on_alloc=False), None, 6,
                              total_num_host_pages=16, max_batch_size=2, enable_runtime_checks=True)  # fmt: skip
    try:
        sub.connect(pub.endpoint)
        sub.subscribe(b"kv")
        assert pub.wait_for_subscribers(1, timeout=5.0)  # the slow joiner has joined: nothing is lost
        seen: list[ev.KVEventBatch] = []
        mgr.add_kv_event_listener(seen.append)
        mgr.add_kv_event_listener(pub)
        scripted_run(mgr)
        shape = [[(type(e).__name__, getattr(e, "medium", None), len(getattr(e, "block_hashes", []))) for e in b.events]
                 for b in seen]  # fmt: skip
        assert shape == EXPECTED_SHAPE
        n = len(seen)

        frames = [receive(sub) for _ in range(n)]
        assert [f[0] for f in frames] == [b"kv"] * n and {len(f) for f in frames} == {3}
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == list(range(n)) == [b.seq for b in seen]  # in order, no gaps
        for (_, _, payload), batch in zip(frames, seen, strict=True):
            wire = DECODER.decode(payload)
            assert wire.ts == batch.ts and wire.data_parallel_rank == 0
            assert wire.events == [as_vllm(e, int_hashes) for e in batch.events]
            assert decode_batch(payload, batch.seq) == ev.KVEventBatch(
                batch.seq, batch.ts, [converted(e, int_hashes) for e in batch.events], 0
            )

        # the raw message: [ts, [maps tagged "type"], rank]; vLLM's fields without a default always present
        raw = msgspec.msgpack.decode(frames[0][2])
        assert len(raw) == 3 and raw[2] == 0
        stored = raw[1][0]
        assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                "medium", "lora_name", "group_idx"]  # fmt: skip
        assert stored["block_hashes"][0] == first_page_hash(algo, int_hashes, mgr.params.kv_hash_seed)
        assert (stored["parent_block_hash"], stored["token_ids"], stored["block_size"]) == (None, PROMPT[:12], 4)
        page3 = DECODER.decode(frames[2][2]).events[0]
        assert page3.token_ids == [13, 100, 101, 102] and page3.parent_block_hash == stored["block_hashes"][2]
        assert msgspec.msgpack.decode(frames[-1][2])[1] == [{"type": "AllBlocksCleared"}]

        # replay from k: batches k..n-1, then the end marker
        dealer.connect(pub.replay_endpoint)
        k = 4
        dealer.send_multipart([b"", k.to_bytes(8, "big")])
        replayed = []
        while True:
            empty, topic, seq, payload = receive(dealer)
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")  # vLLM's end marker, frame for frame
                break
            assert topic == b"kv"
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(s, f[2]) for s, f in zip(seqs, frames, strict=True)][k:]
        assert (pub.published, pub.dropped, pub.errors) == (n, 0, 0)
    finally:
        mgr.close()
        pub.close()
        sub.close(linger=0)
        dealer.close(linger=0)


def test_encoding_is_vllms_msgpack() -> None:
    key = bytes(range(32))
    batch = ev.KVEventBatch(7, 1.5, [ev.AllBlocksCleared()], 2)
    expected = b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91\x81\xa4type\xb0AllBlocksCleared\x02"
    assert encode_batch(batch) == expected
    assert external_block_hash(key) == int.from_bytes(key[24:], "big") == 0x18191A1B1C1D1E1F
    assert external_block_hash(-2) == MASK64 - 1 and external_block_hash(key, int_hashes=False) == key
    events = [ev.BlockStored([key, key[::-1]], None, list(range(8)), 4, "CPU", 1), ev.BlockRemoved([-5], "DISK")]
    raw_batch = ev.KVEventBatch(3, 2.25, events, 1)
    assert decode_batch(encode_batch(raw_batch, int_hashes=False), seq=3) == raw_batch
    ints = decode_batch(encode_batch(raw_batch), seq=3).events
    assert ints == [ev.BlockStored([0x18191A1B1C1D1E1F, 0x0706050403020100], None, list(range(8)), 4, "CPU", 1),
                    ev.BlockRemoved([MASK64 - 4], "DISK")]  # fmt: skip
    wire = DECODER.decode(encode_batch(raw_batch))
    assert wire.data_parallel_rank == 1 and wire.events[1] == BlockRemoved([MASK64 - 4], "DISK", group_idx=0)
    with pytest.raises(ValueError, match="not a vLLM KVEventBatch"):
        decode_batch(msgspec.msgpack.encode({"ts": 1.0}))


def test_endpoint_offsets_follow_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://10.0.0.1:6000", 1) == "tcp://10.0.0.1:6001"
    assert offset_endpoint_port("inproc://cache", 3) == "inproc://cache_dp3"
    with pytest.raises(ValueError, match="cannot offset"):
        offset_endpoint_port("tcp://127.0.0.1:*", 1)


def test_per_rank_publisher_numbers_its_own_batches_and_counts_drops() -> None:
    zctx = zmq.Context.instance()
    pub = ZmqEventPublisher("inproc://pagedkv-events", data_parallel_rank=1, max_queue_size=1)
    assert pub.endpoint == "inproc://pagedkv-events_dp1"
    sub = zctx.socket(zmq.SUB)
    try:
        sub.connect(pub.endpoint)
        sub.subscribe(b"")
        assert pub.wait_for_subscribers(1, timeout=5.0) and pub.num_subscriptions == 1
        batches = [ev.KVEventBatch(i, float(i), [ev.BlockRemoved([i], "GPU")], i % 2) for i in range(400)]
        for batch in batches:  # rank 0's are not this publisher's; a queue of one drops some of rank 1's
            pub(batch)
        pub.close()
        pub(batches[1])  # after close: dropped and counted
        received = []
        while sub.poll(200):
            _, seq, payload = sub.recv_multipart()
            received.append((int.from_bytes(seq, "big"), decode_batch(payload).events))
        assert pub.published + pub.dropped == 201 and pub.published == len(received) >= 1
        seqs = [s for s, _ in received]
        assert seqs == sorted(set(seqs)) and len(set(range(200)) - set(seqs)) == pub.dropped - 1
        assert all(events == [ev.BlockRemoved([2 * s + 1], "GPU")] for s, events in received)
    finally:
        pub.close()
        sub.close(linger=0)


def test_optional_dependencies_stay_lazy() -> None:
    code = (
        "import sys\n"
        "import pagedkv, pagedkv.observability\n"
        "pagedkv.PagedKVCacheManager\n"
        "assert not {'zmq', 'msgspec', 'prometheus_client'} & set(sys.modules), sorted(sys.modules)\n"
        "sys.modules['zmq'] = sys.modules['prometheus_client'] = None\n"
        "from pagedkv.observability import PagedKVCollector, ZmqEventPublisher\n"
        "for make, extra in ((ZmqEventPublisher, 'events'), (lambda: PagedKVCollector(None), 'metrics')):\n"
        "    try:\n"
        "        make()\n"
        "    except ImportError as exc:\n"
        "        assert f\"pip install 'pagedkv[{extra}]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError('no ImportError')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
