"""`PrefixIndex`: which blocks each engine holds, from their ZMQ KV event streams, and prefix scores.

One background thread owns every socket: a SUB per engine (connected to its PUB endpoint, filtered
on its topic) and, on demand, a DEALER to its replay ROUTER. Each message is
``(topic, seq as 8-byte big-endian, payload)``. ZMQ's subscription is a prefix match (subscribed to
``kv``, the socket also gets ``kvX`` and ``kv-metrics``), so the topic frame is compared exactly: a
message (live or replayed) of any other topic is counted in ``stats.other_topics`` and skipped.
Then, by ``seq``:

- ``seq`` equal to the one expected: the batch is applied.
- ``seq`` above it (a gap: the PUB socket dropped messages, or the router joined late; the first
  message of a stream expects 0): the thread asks the replay socket for ``[b"", expected as 8 bytes]``,
  applies the batches ``expected .. seq-1`` it answers with (``[b"", topic, seq, payload]`` from vLLM,
  ``[b"", seq, payload]`` from pagedkv, until a seq of -1), then the live batch. What the replay could
  not supply is counted in ``stats.unrecovered`` and otherwise ignored.
- ``seq`` below it: the publisher restarted (vLLM's sequence restarts at 0 with each publisher);
  the engine's entries are dropped (its cache started empty) and a replay from 0 fills in what the
  new publisher sent before this message.
- A message that cannot be read (frame count, seq width, payload) is counted in ``stats.malformed``
  and skipped; nothing in a message can stop the thread.

pyzmq and msgspec are imported when the index starts (``pip install 'pagedkv[router]'``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedkv.router.hashers import BlockHasher
from pagedkv.router.state import EngineCache, StreamStats
from pagedkv.router.wire import WireBatch, decode_payload

__all__ = ["EngineSpec", "PrefixIndex"]

log = logging.getLogger(__name__)
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_EXTRA = "pip install 'pagedkv[router]'"


@dataclass(frozen=True)
class EngineSpec:
    """One engine behind the router.

    Attributes:
        name: unique name (used in scores, decisions and metrics).
        endpoint: the engine's KV event PUB endpoint (``tcp://host:port``); the index connects to it.
        hasher: how the engine hashes blocks (`PagedKVHasher`, `VLLMHasher`); engines given the same
            hasher object hash a request once.
        replay_endpoint: the engine's replay ROUTER endpoint (None: gaps are counted, not filled).
        topic: the topic the engine publishes under; only messages of exactly this topic are applied.
        url: the engine's HTTP base URL, for `Router` load scrapes and the proxy (None: none).
    """

    name: str
    endpoint: str
    hasher: BlockHasher
    replay_endpoint: str | None = None
    topic: str = ""
    url: str | None = None


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(f"the KV-aware router needs pyzmq: {_EXTRA}") from exc
    return zmq


class PrefixIndex:
    """Per engine and medium, the block hashes announced as held; `score` gives leading tokens held.

    Args:
        engines: the engines (names unique).
        replay_timeout_s: how long one replay may take before the rest of the gap is given up.
        start: subscribe at once (False: call `start`; `ingest` works either way).

    Thread safety: `score`, `stats`, `num_blocks` and `last_message` may be called from any thread
    while the subscriber thread applies events (one lock guards the state).
    """

    def __init__(self, engines: Sequence[EngineSpec], *, replay_timeout_s: float = 2.0, start: bool = True) -> None:
        names = [e.name for e in engines]
        if not engines or len(set(names)) != len(names):
            raise ValueError(f"engines={names!r} must be a non-empty list of uniquely named EngineSpecs")
        if not replay_timeout_s > 0:
            raise ValueError(f"replay_timeout_s={replay_timeout_s!r} must be > 0")
        self.engines: dict[str, EngineSpec] = {e.name: e for e in engines}
        self.replay_timeout_s = float(replay_timeout_s)
        self._caches = {name: EngineCache() for name in names}
        self._topics = {e.name: e.topic.encode() for e in engines}  # the exact first frame of each stream
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()  # set once the initial replays are done
        self._thread: threading.Thread | None = None
        self._dealers: dict[str, Any] = {}
        self._synced: dict[str, dict[int, bytes]] = {}  # per engine, seq -> payload applied by the initial replay
        if start:
            self.start()

    # ----------------------------------------------------------------- queries
    def score(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> dict[str, int]:
        """Per engine, how many leading tokens of `tokens` it holds in some medium: whole blocks of
        ``tokens[:-1]`` whose hashes (computed the engine's way, with `salt`) it announced and did
        not remove, times its block size. No side effects (a hasher may memoize digests)."""
        by_hasher: dict[int, list[bytes | int]] = {}
        hashes = {}
        for name, spec in self.engines.items():
            key = id(spec.hasher)
            if key not in by_hasher:
                by_hasher[key] = spec.hasher.hashes(tokens, salt)
            hashes[name] = by_hasher[key]
        with self._lock:
            return {n: self._caches[n].leading_blocks(h) * self.engines[n].hasher.block_size for n, h in hashes.items()}

    def score_by_medium(self, tokens: Sequence[int] | np.ndarray, salt: str | None = None) -> dict[str, dict[str, int]]:
        """Per engine and medium, the leading tokens that medium alone holds (see `score`)."""
        with self._lock:
            caches = dict(self._caches)
        out = {}
        for name, spec in self.engines.items():
            hashes = spec.hasher.hashes(tokens, salt)
            with self._lock:
                blocks = caches[name].leading_blocks_by_medium(hashes)
            out[name] = {m: n * spec.hasher.block_size for m, n in blocks.items()}
        return out

    def num_blocks(self, name: str) -> dict[str, int]:
        """Blocks `name` holds per medium. KeyError names an unknown engine."""
        with self._lock:
            return self._cache(name).num_blocks()

    def stats(self, name: str) -> StreamStats:
        """A copy of `name`'s stream counters."""
        with self._lock:
            return StreamStats(**vars(self._cache(name).stats))

    def last_message(self, name: str) -> float | None:
        """`time.monotonic()` of `name`'s last message (None: none yet)."""
        with self._lock:
            return self._cache(name).last_message

    def next_seq(self, name: str) -> int | None:
        """The sequence number expected next from `name` (None: nothing received yet)."""
        with self._lock:
            return self._cache(name).next_seq

    def _cache(self, name: str) -> EngineCache:
        cache = self._caches.get(name)
        if cache is None:
            raise KeyError(f"engine={name!r} is not one of {sorted(self._caches)}")
        return cache

    # ----------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Connect the SUB sockets and start the subscriber thread (idempotent). Raises ImportError
        without pyzmq / msgspec."""
        if self._thread is not None:
            return
        zmq = _zmq()
        try:
            import msgspec  # noqa: F401  (fail here, not on the first payload)
        except ImportError as exc:
            raise ImportError(f"the KV-aware router needs msgspec: {_EXTRA}") from exc
        ctx = zmq.Context.instance()
        subs = {}
        for name, spec in self.engines.items():
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(spec.endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
            subs[name] = sock
        self._thread = threading.Thread(target=self._run, args=(subs,), name="pagedkv-router-index", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Block until the thread has asked every engine's replay socket for what it buffers (the
        initial sync; an engine that does not answer costs `replay_timeout_s`). True when done."""
        return self._ready.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close its sockets (idempotent); the entries stay readable."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> PrefixIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, subs: dict[str, Any]) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        by_socket = {}
        for name, sock in subs.items():
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = name
        try:
            for name, spec in self.engines.items():  # initial sync: what each publisher still buffers
                if spec.replay_endpoint is not None and not self._stop.is_set():
                    self._replay(name, 0, None)
            self._ready.set()
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    for _ in range(1000):  # drain, but give the others a turn
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self.ingest(by_socket[sock], frames)
                        except Exception:  # never fatal: a bug here must not stop the index
                            log.exception("KV event message from %s not applied", by_socket[sock])
        finally:
            for sock in [*subs.values(), *self._dealers.values()]:
                sock.close(linger=0)
            self._dealers.clear()

    # ----------------------------------------------------------------- messages
    def ingest(self, name: str, frames: Sequence[bytes]) -> None:
        """Apply one live message ``[topic, seq, payload]`` from engine `name` (the subscriber thread
        calls this; tests and benchmarks may too, from one thread). A gap or a restart triggers a replay
        from this thread (when the engine has a replay endpoint and the index was started). Malformed
        messages are counted and skipped, and so are messages of another topic (`StreamStats.other_topics`)."""
        cache = self._cache(name)
        if frames and bytes(frames[0]) != self._topics[name]:  # (SUBSCRIBE matched a prefix only)
            with self._lock:
                cache.stats.other_topics += 1
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            with self._lock:
                cache.stats.malformed += 1
                cache.last_message = time.monotonic()
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch: WireBatch | None = decode_payload(bytes(frames[2]))
        except ValueError:
            batch = None
        with self._lock:
            cache.last_message = time.monotonic()
            expected = cache.next_seq
            synced = self._synced.get(name)
            if expected is not None and seq < expected:
                if synced is not None and synced.get(seq) == bytes(frames[2]):
                    return  # already applied from the initial replay
                cache.stats.restarts += 1
                cache.clear()
                expected = 0
            elif expected is None:
                expected = 0
            if seq > expected:
                cache.stats.gaps += 1
            if seq >= (cache.next_seq or 0):
                self._synced.pop(name, None)  # the live stream has caught up with the replay
        if seq > expected:
            self._replay(name, expected, seq)
        with self._lock:
            if batch is None:
                cache.stats.malformed += 1
            else:
                cache.apply(batch)
            cache.next_seq = seq + 1

    def _replay(self, name: str, start: int, stop: int | None) -> None:
        """Apply batches [start, stop) from `name`'s replay socket; count what it could not supply.
        `stop` None: the initial sync: every buffered batch, after which the next live seq is expected."""
        spec, cache = self.engines[name], self._caches[name]
        if spec.replay_endpoint is None or self._thread is None:
            with self._lock:
                cache.stats.unrecovered += 1
            return
        zmq = _zmq()
        dealer = self._dealers.get(name)
        if dealer is None:
            dealer = self._dealers[name] = zmq.Context.instance().socket(zmq.DEALER)
            dealer.connect(spec.replay_endpoint)
        with self._lock:
            cache.stats.replays += 1
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline, expected, done, missed = time.monotonic() + self.replay_timeout_s, start, False, False
        while not done and (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(int(left * 1000) + 1):
                break
            frames = dealer.recv_multipart()
            if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                with self._lock:
                    cache.stats.malformed += 1
                continue
            if frames[-2] == _END_SEQ:
                done = True
                continue
            if len(frames) == 4 and frames[1] != self._topics[name]:  # (vLLM's answers carry the topic)
                with self._lock:
                    cache.stats.other_topics += 1
                continue
            seq = int.from_bytes(frames[-2], "big")
            if seq < expected or (stop is not None and seq >= stop):
                continue
            missed |= seq > expected  # the buffer no longer reached back that far
            try:
                batch = decode_payload(bytes(frames[-1]))
            except ValueError:
                with self._lock:
                    cache.stats.malformed += 1
                continue
            with self._lock:
                cache.apply(batch)
                cache.stats.replayed += 1
                if stop is None:
                    cache.next_seq = seq + 1
                    cache.last_message = time.monotonic()
                    self._synced.setdefault(name, {})[seq] = bytes(frames[-1])
            expected = seq + 1
        if not done:  # late answers would confuse the next replay: start over with a new socket
            dealer.close(linger=0)
            del self._dealers[name]
        if missed or (stop is not None and expected < stop):
            with self._lock:
                cache.stats.unrecovered += 1
