"""A scripted KV event publisher on real ZMQ sockets, framed exactly as vLLM's `ZmqEventPublisher`
(PUB ``[topic, seq, payload]``; replay ROUTER answering ``[b"", topic, seq, payload]`` then
``[b"", b"", -1, b""]``), that can leave batches out of the live stream (they stay replayable)."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _bind(sock: Any, endpoint: str) -> None:
    """Bind, retrying for a moment: ZMQ releases a closed socket's port asynchronously."""
    for _ in range(100):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.05)
    sock.bind(endpoint)


class ScriptedPublisher:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", replay_endpoint: str = "tcp://127.0.0.1:*",
                 topic: bytes = b"kv") -> None:  # fmt: skip
        ctx = zmq.Context.instance()
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)  # XPUB: the subscription can be waited for (wire-identical to PUB)
        _bind(self.pub, endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        _bind(self.router, replay_endpoint)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_for_subscriber(self, timeout_ms: int = 5000) -> None:
        assert self.pub.poll(timeout_ms), "no subscriber within the timeout"
        assert self.pub.recv()[:1] == b"\x01"

    def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        with self._lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            ident, empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in batches:
                self.router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def stored(hashes: list[Any], medium: str = "GPU", parent: Any = None) -> dict[str, Any]:
    """vLLM's BlockStored map (tokens left out of the router's concern)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [],
            "block_size": 4, "lora_id": None, "medium": medium, "lora_name": None}  # fmt: skip


def removed(hashes: list[Any], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
