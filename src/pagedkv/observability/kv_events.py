"""KV events over ZMQ in vLLM's wire format (`vllm/distributed/kv_events.py`).

`ZmqEventPublisher` is a `PagedKVCacheManager` event listener
(``mgr.add_kv_event_listener(publisher)``). Each `KVEventBatch` becomes one
ZMQ multipart message ``(topic, seq as 8-byte big-endian, payload)`` where the
payload is msgspec msgpack of vLLM's ``KVEventBatch``: an array
``[ts, [event, ...], data_parallel_rank]`` whose events are maps tagged
``"type"`` ("BlockStored", "BlockRemoved", "AllBlocksCleared"). Hashes are
vLLM's ``ExternalBlockHash``: by default the lower 64 bits of the key as an
unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), or the raw key
(``int_hashes=False``). ``medium`` keeps pagedkv's names: "GPU" (device pool),
"CPU" (host), "DISK", "REDIS".

Data parallelism: vLLM runs one publisher per DP rank on ``port + rank``.
By default one publisher here serves every replica of the manager, each batch
carrying its replica index as ``data_parallel_rank`` and the sequence numbers
running across replicas. ``data_parallel_rank=r`` gives vLLM's layout instead:
the publisher sends only replica ``r``'s batches, numbered from 0, on the
endpoints offset by ``r`` (`offset_endpoint_port`); attach one per replica.

pyzmq and msgspec are imported when a publisher is built or a batch encoded
(``pip install 'pagedkv[events]'``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from pagedkv.core.hashing import BlockHash

__all__ = [
    "END_SEQ", "ZmqEventPublisher", "decode_batch", "encode_batch", "external_block_hash", "offset_endpoint_port",
    "wire_event",
]  # fmt: skip

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame closing a replay answer (its payload frame is empty)."""
_MASK64 = (1 << 64) - 1
_EXTRA = "pip install 'pagedkv[events]'"


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(f"KV events over ZMQ need pyzmq: {_EXTRA}") from exc
    return zmq


def _msgpack() -> Any:
    try:
        import msgspec.msgpack
    except ImportError as exc:
        raise ImportError(f"KV event encoding needs msgspec: {_EXTRA}") from exc
    return msgspec.msgpack


def external_block_hash(block_hash: BlockHash, int_hashes: bool = True) -> int | bytes:
    """The hash as vLLM's events carry it: with `int_hashes`, the lower 64 bits as an unsigned int
    (bytes read big-endian, as vLLM's `maybe_convert_block_hash`); otherwise unchanged."""
    if not int_hashes:
        return block_hash
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


def wire_event(event: KVEvent, int_hashes: bool = True) -> dict[str, Any]:
    """One event as the map vLLM's tagged, `omit_defaults` msgspec Struct encodes to (fields in its
    order; `lora_id`, `medium` and `lora_name` have no default there, so they are always present)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {
            "type": "BlockStored",
            "block_hashes": [external_block_hash(h, int_hashes) for h in event.block_hashes],
            "parent_block_hash": None if parent is None else external_block_hash(parent, int_hashes),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            "group_idx": event.group_idx,
            **({} if event.kv_cache_spec_kind is None else {"kv_cache_spec_kind": event.kv_cache_spec_kind}),
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [external_block_hash(h, int_hashes) for h in event.block_hashes],
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(batch: KVEventBatch, int_hashes: bool = True) -> bytes:
    """vLLM's payload for one batch: msgpack ``[ts, [event maps], data_parallel_rank]``. No side effects."""
    return bytes(_msgpack().encode(_wire_batch(batch, int_hashes)))


def _wire_batch(batch: KVEventBatch, int_hashes: bool) -> list[Any]:
    return [batch.ts, [wire_event(e, int_hashes) for e in batch.events], batch.data_parallel_rank]


def decode_batch(payload: bytes, seq: int = -1) -> KVEventBatch:
    """A vLLM payload back as a `KVEventBatch` numbered `seq` (hashes as sent: ints or bytes; fields
    pagedkv does not model, such as `lora_name`, are dropped; a missing rank reads as 0).

    Raises ValueError for a payload that is not a vLLM event batch."""
    data = _msgpack().decode(payload)
    if not isinstance(data, list) or len(data) not in (2, 3) or not isinstance(data[1], list):
        raise ValueError("not a vLLM KVEventBatch payload: expected [ts, events, dp_rank]")
    events: list[KVEvent] = []
    for raw in data[1]:
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "BlockStored":
            events.append(BlockStored(list(raw["block_hashes"]), raw.get("parent_block_hash"),
                                      list(raw.get("token_ids", [])), int(raw["block_size"]),
                                      raw.get("medium") or "GPU", raw.get("group_idx") or 0,
                                      raw.get("kv_cache_spec_kind")))  # fmt: skip
        elif kind == "BlockRemoved":
            events.append(
                BlockRemoved(list(raw["block_hashes"]), raw.get("medium") or "GPU", raw.get("group_idx") or 0)
            )
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event {raw!r}")
    rank = data[2] if len(data) == 3 and data[2] is not None else 0
    return KVEventBatch(seq, float(data[0]), events, int(rank))


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's per-DP-rank endpoint: the TCP port plus `rank`, or ``_dp{rank}`` appended to an inproc
    or ipc name (unchanged for rank 0)."""
    if not rank:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"endpoint={endpoint!r}: cannot offset the port of a non-TCP or wildcard-port endpoint")
    return f"{base}:{int(port) + rank}"


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc address; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes `KVEventBatch`es on a ZMQ PUB socket from a background thread, with replay.

    Args:
        endpoint: PUB address; bound when it holds ``*`` (``tcp://*:5557``, or ``tcp://127.0.0.1:*``
            for a free port, see `endpoint`), ``::``, ipc or inproc, else connected (to a proxy).
        replay_endpoint: optional ROUTER address (always bound). A DEALER client sends
            ``[b"", start seq as 8 bytes big-endian]`` and gets one ``[b"", topic, seq, payload]``
            message per buffered batch with ``seq >= start``, then ``[b"", b"", END_SEQ, b""]``
            (vLLM's framing, frame for frame; a REQ socket would keep only the first message).
        topic: the first frame of every message (subscribers filter on it).
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (messages per subscriber).
        max_queue_size: batches waiting for the thread; beyond it `__call__` drops (see `dropped`).
        int_hashes: hashes as the lower 64 bits (vLLM's default) or raw keys.
        data_parallel_rank: None: every replica's batches; r: only replica r's, on endpoints
            offset by r and numbered from 0 (vLLM's one publisher per rank).
        linger_s: how long `close` lets queued messages drain to subscribers.
        bind: bind (True) or connect (False) the PUB socket; None: vLLM's rule above. True binds a
            fixed loopback port (``tcp://127.0.0.1:5557``), which the rule would connect to.

    Calling the publisher never blocks: it numbers the batch and queues it. Sequence numbers
    count every batch accepted, dropped ones included, so a subscriber sees a drop as a gap.
    The socket is an XPUB (wire-identical to PUB for subscribers) so `wait_for_subscribers`
    can tell when a subscription arrived (ZMQ's slow joiner).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        int_hashes: bool = True,
        data_parallel_rank: int | None = None,
        linger_s: float = 1.0,
        bind: bool | None = None,
    ) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue_size", max_queue_size)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        zmq = self._zmq = _zmq()
        self._encoder = _msgpack().Encoder()
        rank = data_parallel_rank or 0
        self.data_parallel_rank = data_parallel_rank
        self.int_hashes = bool(int_hashes)
        self.topic = topic.encode()
        self._linger_ms = max(0, int(linger_s * 1000))
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSER if hasattr(zmq, "XPUB_VERBOSER") else zmq.XPUB_VERBOSE, 1)
        self._replay: Any = None
        try:
            self.endpoint = self._attach(
                self._pub, offset_endpoint_port(endpoint, rank), _binds(endpoint) if bind is None else bool(bind)
            )
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)  # a whole replay fits: ROUTER drops silently
                self.replay_endpoint = self._attach(self._replay, offset_endpoint_port(replay_endpoint, rank), True)
        except Exception:
            self._close_sockets(0)
            raise
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.published = self.dropped = self.errors = 0
        self._subscriptions = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # numbering and queueing are atomic (several callers, close)
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    def _attach(self, sock: Any, endpoint: str, bind: bool) -> str:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        last = sock.getsockopt(self._zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)

    # ----------------------------------------------------------------- engine side
    def __call__(self, batch: KVEventBatch) -> None:
        """Queue `batch` (never blocks). Batches of other replicas are ignored when the publisher
        serves one rank; a full queue, or a closed publisher, drops the batch and counts it."""
        if self.data_parallel_rank is not None and batch.data_parallel_rank != self.data_parallel_rank:
            return
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            try:
                if self._closed:
                    raise queue.Full
                self._queue.put_nowait((seq, batch))
            except queue.Full:
                self.dropped += 1

    def wait_for_subscribers(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until `count` subscriptions have reached the socket (True) or `timeout` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: self._subscriptions >= count, timeout)

    @property
    def num_subscriptions(self) -> int:
        """Subscriptions currently held by connected subscribers (one per SUB per topic prefix)."""
        return self._subscriptions

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (= batches numbered so far)."""
        return self._next_seq

    @property
    def queued(self) -> int:
        """Batches waiting for the publisher thread."""
        return self._queue.qsize()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting batches, publish those queued, stop the thread and close the sockets
        (lingering `linger_s` for subscribers to read). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- publisher thread
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll(0):
                    self._serve(sock)
                try:
                    seq, batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    if self._stop.is_set():  # closed: nothing more is queued after this drain
                        while not self._queue.empty():
                            self._publish(*self._queue.get_nowait())
                        break
                    continue
                self._publish(seq, batch)
        finally:
            self._close_sockets(self._linger_ms)

    def _publish(self, seq: int, batch: KVEventBatch) -> None:
        try:
            payload = self._encoder.encode(_wire_batch(batch, self.int_hashes))
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except Exception:
            self.errors += 1
            log.exception("KV event batch %d not published", seq)
            return
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve(self, sock: Any) -> None:
        try:
            frames = sock.recv_multipart(self._zmq.NOBLOCK)
        except self._zmq.Again:
            return
        if sock is self._pub:  # a subscription message: b"\x01" + topic or b"\x00" + topic
            if frames and frames[0][:1] in (b"\x00", b"\x01"):
                with self._cond:
                    self._subscriptions += 1 if frames[0][:1] == b"\x01" else -1
                    self._cond.notify_all()
            return
        if len(frames) not in (2, 3) or len(frames[-1]) != 8:
            log.warning("invalid KV event replay request: %r", frames)
            return
        head = frames[:-1]  # [identity] or [identity, b""]
        start = int.from_bytes(frames[-1], "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                sock.send_multipart([*head, self.topic, seq.to_bytes(8, "big"), payload])
        sock.send_multipart([*head, b"", END_SEQ, b""])

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
