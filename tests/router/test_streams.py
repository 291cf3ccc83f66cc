"""The index's stream handling on real sockets: gaps filled by replay, restarts, late joiners, malformed
messages, clears, and both event encodings (tagged maps and msgspec arrays)."""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from engines import wait_for  # noqa: E402
from publisher import ScriptedPublisher, removed, stored  # noqa: E402

from pagedkv.core import events as ev  # noqa: E402
from pagedkv.observability import ZmqEventPublisher  # noqa: E402
from pagedkv.router import EngineSpec, PagedKVHasher, PrefixIndex  # noqa: E402
from pagedkv.router.wire import decode_payload  # noqa: E402

HASHER = PagedKVHasher(4, seed=bytes(32))
PROMPT = list(range(1, 42))  # 10 full pages of tokens[:-1]
KEYS = HASHER.hashes(PROMPT)


def payload(*events: dict[str, object], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), 0])


def start(pub: ScriptedPublisher) -> PrefixIndex:
    index = PrefixIndex([EngineSpec("e", pub.endpoint, HASHER, pub.replay_endpoint, "kv")], replay_timeout_s=2.0)
    pub.wait_for_subscriber()
    assert index.wait_ready()
    return index


def score(index: PrefixIndex) -> int:
    return index.score(PROMPT)["e"]


def test_gap_is_filled_from_the_replay_socket() -> None:
    pub = ScriptedPublisher()
    index = start(pub)
    try:
        pub.send(0, payload(stored(KEYS[:2])))
        pub.send(1, payload(stored(KEYS[2:4])), live=False)  # lost on the way: only the replay has it
        pub.send(2, payload(stored(KEYS[4:5])))
        wait_for(lambda: index.next_seq("e") == 3)
        assert score(index) == 20
        stats = index.stats("e")
        assert (stats.gaps, stats.replayed, stats.unrecovered, stats.restarts) == (1, 1, 0, 0)
        assert pub.replay_requests[-1] == 1
    finally:
        index.close()
        pub.close()


def test_a_gap_the_buffer_cannot_fill_is_counted_and_the_stream_goes_on() -> None:
    pub = ScriptedPublisher()
    index = start(pub)
    try:
        pub.send(0, payload(stored(KEYS[:2])))
        pub.send(5, payload(stored(KEYS[2:3])))  # 1..4 are nowhere
        wait_for(lambda: index.next_seq("e") == 6)
        stats = index.stats("e")
        assert (stats.gaps, stats.unrecovered) == (1, 1)
        assert score(index) == 12
    finally:
        index.close()
        pub.close()


def test_a_sequence_decrease_means_a_restarted_publisher() -> None:
    pub = ScriptedPublisher()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    index = start(pub)
    try:
        for seq in range(3):
            pub.send(seq, payload(stored(KEYS[seq : seq + 1])))
        wait_for(lambda: index.next_seq("e") == 3)
        assert score(index) == 12
        pub.close()
        pub = ScriptedPublisher(endpoint, replay)  # same addresses, numbering from 0, an empty cache
        pub.wait_for_subscriber(10_000)
        pub.send(0, payload(stored(KEYS[:1])))
        wait_for(lambda: index.stats("e").restarts == 1)
        wait_for(lambda: index.next_seq("e") == 1)
        assert score(index) == 4  # what the old publisher announced is gone
    finally:
        index.close()
        pub.close()


def test_malformed_messages_are_counted_and_skipped() -> None:
    pub = ScriptedPublisher()
    index = start(pub)
    try:
        pub.raw([b"kv"])  # one frame
        pub.raw([b"kv", b"\x00\x01", payload(stored(KEYS[:1]))])  # a 2-byte seq
        pub.send(0, b"\xc1 not msgpack")
        pub.send(1, payload({"type": "BlockExploded", "block_hashes": [1]}))
        pub.send(2, msgspec.msgpack.encode({"not": "a batch"}))
        pub.send(3, payload(stored(["not a hash"])))
        pub.send(4, payload(stored(KEYS[:3])))
        wait_for(lambda: index.next_seq("e") == 5)
        stats = index.stats("e")
        assert stats.malformed == 6 and stats.gaps == 0
        assert score(index) == 12
    finally:
        index.close()
        pub.close()


def test_removals_clears_and_mediums() -> None:
    pub = ScriptedPublisher()
    index = start(pub)
    try:
        pub.send(0, payload(stored(KEYS[:4]), stored(KEYS[:6], medium="CPU")))
        pub.send(1, payload(removed(KEYS[1:2])))  # GPU loses page 1: CPU still has it
        wait_for(lambda: index.next_seq("e") == 2)
        assert score(index) == 24
        assert index.score_by_medium(PROMPT)["e"] == {"GPU": 4, "CPU": 24}
        pub.send(2, payload(removed(KEYS[3:4], medium="CPU")))
        wait_for(lambda: index.next_seq("e") == 3)
        assert score(index) == 24  # page 3 left CPU, GPU still has it
        pub.send(3, payload(removed(KEYS[3:4])))
        wait_for(lambda: index.next_seq("e") == 4)
        assert score(index) == 12  # pages 0-2 (GPU: 0, 2; CPU: 0-2), page 3 nowhere
        pub.send(4, payload({"type": "AllBlocksCleared"}))
        wait_for(lambda: index.next_seq("e") == 5)
        assert score(index) == 0 and index.num_blocks("e") == {}
        assert index.stats("e").clears == 1
    finally:
        index.close()
        pub.close()


def test_a_late_joiner_syncs_from_pagedkv_replay_without_double_counting() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    try:
        pub(ev.KVEventBatch(0, time.time(), [ev.BlockStored(KEYS[:3], None, [], 4)]))
        pub(ev.KVEventBatch(1, time.time(), [ev.BlockRemoved(KEYS[2:3])]))
        wait_for(lambda: pub.published == 2)
        assert pub.replay_endpoint is not None
        index = PrefixIndex([EngineSpec("e", pub.endpoint, HASHER, pub.replay_endpoint, "kv")])
        try:
            wait_for(lambda: index.next_seq("e") == 2)  # from the replay: nothing was live since
            assert score(index) == 8
            assert pub.wait_for_subscribers(1)
            pub(ev.KVEventBatch(2, time.time(), [ev.BlockStored(KEYS[2:5], KEYS[1], [], 4)]))
            wait_for(lambda: index.next_seq("e") == 3)
            assert score(index) == 20
            stats = index.stats("e")
            assert (stats.replayed, stats.restarts, stats.gaps, stats.batches) == (2, 0, 0, 3)
        finally:
            index.close()
    finally:
        pub.close()


def test_array_like_events_decode_by_position() -> None:
    """Publishers before vLLM PR #42892 sent msgspec array_like events: tag first, fields by position."""
    old = msgspec.msgpack.encode([2.5, [["BlockStored", [7, 8], None, [1, 2, 3, 4] * 2, 4, None, "CPU"],
                                        ["BlockRemoved", [7], "GPU"], ["AllBlocksCleared"]], 1])  # fmt: skip
    batch = decode_payload(old)
    assert batch.ts == 2.5 and batch.data_parallel_rank == 1
    assert [(e.kind, e.block_hashes, e.medium) for e in batch.events] == [
        ("BlockStored", (7, 8), "CPU"), ("BlockRemoved", (7,), "GPU"), ("AllBlocksCleared", (), "GPU")]  # fmt: skip
    with pytest.raises(ValueError, match="not a KV event"):
        decode_payload(msgspec.msgpack.encode([1.0, [["Nope"]], 0]))


def test_router_imports_stay_lazy() -> None:
    import subprocess
    import sys

    code = ("import sys, pagedkv, pagedkv.router, pagedkv.router.engine_server\n"
            "bad = {'zmq', 'msgspec', 'aiohttp'} & set(sys.modules)\n"
            "assert not bad, bad\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_fixed_loopback_port_is_bound_when_asked() -> None:
    """vLLM's rule connects ``tcp://127.0.0.1:PORT``; ``bind=True`` binds it (`pagedkv engine --events-port`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", topic="kv", bind=True)
    index = PrefixIndex([EngineSpec("e", f"tcp://127.0.0.1:{port}", HASHER, None, "kv")])
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}" and pub.wait_for_subscribers(1)
        pub(ev.KVEventBatch(0, time.time(), [ev.BlockStored(KEYS[:2], None, [], 4)]))
        wait_for(lambda: index.next_seq("e") == 1)
        assert score(index) == 8
    finally:
        index.close()
        pub.close()


def test_messages_of_a_longer_topic_are_counted_not_applied() -> None:
    """A SUB socket subscribed to ``kv`` also gets ``kvX`` and ``kv-metrics`` (ZMQ matches prefixes): the
    index compares the topic frame exactly, so only ``kv`` batches apply and their numbering is untouched."""
    pub = ScriptedPublisher()
    index = start(pub)
    try:
        pub.send(0, payload(stored(KEYS[:1])))
        pub.raw([b"kvX", (1).to_bytes(8, "big"), payload(stored(KEYS[:5]))])
        pub.raw([b"kv-metrics", (2).to_bytes(8, "big"), payload(stored(KEYS[:4]))])
        pub.raw([b"kv-metrics", b"not", b"a", b"batch"])
        pub.send(1, payload(stored(KEYS[1:2], parent=KEYS[0])))
        pub.send(2, payload(stored(KEYS[2:3], parent=KEYS[1])))
        wait_for(lambda: index.next_seq("e") == 3)
        stats = index.stats("e")
        assert (score(index), stats.batches, stats.gaps, stats.restarts, stats.malformed) == (12, 3, 0, 0, 0)
        assert stats.other_topics == 3
    finally:
        index.close()
        pub.close()


def test_a_publisher_of_another_topic_is_ignored_live_and_in_replays() -> None:
    """The replay answers of a publisher whose topic only starts with the engine's are skipped too."""
    pub = ScriptedPublisher(topic=b"kv-metrics")
    pub.send(0, payload(stored(KEYS[:3])), live=False)  # buffered: the initial replay answers it
    index = start(pub)
    try:
        pub.send(1, payload(stored(KEYS[:5])))
        wait_for(lambda: index.last_message("e") is not None or getattr(index.stats("e"), "other_topics", 0) == 2)
        stats = index.stats("e")
        assert (stats.batches, stats.replayed, index.next_seq("e"), score(index)) == (0, 0, None, 0)
        assert stats.other_topics == 2
    finally:
        index.close()
        pub.close()
